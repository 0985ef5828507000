"""What the Hugging Face converters (`hf`, `hf_vision`, `safetensors_io`) share: the error
they raise and the dtypes a tensor may be stored in."""
from __future__ import annotations

from typing import Sequence

# Stored dtypes (safetensors names) that hold a float parameter exactly or by rounding.
# F8 is not among them: an FP8 `weight` holds a float only with its block scale
# (`weight_scale_inv`, k25jax/convert/fp8.py), which `hf.load` applies where config.json says fp8.
FLOAT = ("F32", "F16", "BF16", "F64")
INTEGER = ("I64", "I32", "I16", "I8", "U8")


class CheckpointError(ValueError):
  """A checkpoint that cannot be loaded as this model: a file that is not a well-formed
  safetensors or config.json, a tensor of the wrong dtype or shape, one missing or with no
  place. The message names the file (or folder) and the tensor where there is one."""


def at(file: str, name: str | None = None) -> str:
  """The start of an error message: `file: tensor 'name'` (or just the file)."""
  return f"{file}: tensor {name!r}" if name is not None else str(file)


def require_dtype(file, name: str, allowed: Sequence[str], what: str = "a float parameter") -> str:
  """The stored dtype of tensor `name` of SafetensorsFile `file`, if it is one of `allowed`;
  otherwise a CheckpointError naming the file and the tensor (nothing is cast)."""
  dtype = file.dtype(name)
  if dtype not in allowed:
    hint = (" (an FP8 weight, but config.json has no quantization_config with quant_method 'fp8' for its "
            "block scales)"
            if dtype.startswith("F8") else "")
    raise CheckpointError(f"{at(file.path, name)} is stored as {dtype}{hint}; {what} must be "
                          f"stored as one of {', '.join(allowed)}")
  return dtype


def shape_error(where: str, shape, want, key: tuple, ours) -> CheckpointError:
  """`where` (see `at`) is stored with `shape` where the config expects `want` (both in the
  checkpoint's layout), for the param `key` of shape `ours` (k25jax's layout)."""
  return CheckpointError(f"{where} has shape {tuple(shape)}, this config expects {tuple(want)} "
                         f"(the checkpoint's layout of {'/'.join(key)}, {tuple(ours)} in k25jax's)")
