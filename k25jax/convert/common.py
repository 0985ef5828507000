"""What the Hugging Face converters (`hf`, `hf_vision`) share: the error they raise."""


class CheckpointError(ValueError):
  """A checkpoint that disagrees with its config (names the offending tensor)."""
