"""What every stage config shares: the model, optimizer, mesh and init sections, and the
one convention for where a run starts and how long it runs.

Configs are data: this module imports `ml_collections` and the model presets
(`k25jax/model/config.py`, plain dataclasses), never jax.

Where a run starts (`init`), the same in every stage:
  init.checkpoint       a workdir of a run of the same model, any stage: the run starts
                        from its latest params ('' = a fresh init, or the stage's built-in
                        warm start where it has one: rl, parl); a text-only stage also
                        starts from a K2.5 run of its decoder (the K2.5 language model)
  init.text_checkpoint  (K2.5 stages only) a text-only run's workdir (configs/pretrain.py),
                        or a K2.5 run's: the language model starts from its decoder's params,
                        the rest fresh
  init.hf_checkpoint    a local Hugging Face folder (DeepSeek-V3 family, Kimi-K2.5, or any
                        folder `k25jax.export` wrote): `python -m k25jax.main` takes the run's
                        model section from its config.json (a `--config.model.*` field that
                        disagrees is an error); a K2.5 stage from a text folder starts its
                        language model from it, the rest fresh (k25jax/train/hf_init.py)
A run always resumes from its own workdir's latest checkpoint first; `init` only
chooses the params of a run that has none yet (one of its fields at most).

How long a run is (`train`), the same in every stage:
  train.steps           supervised stages: optimizer steps; RL stages (rl, rl_vision, parl):
                        iterations, each one round of rollouts then `rl.minibatches` updates
  train.log_every, eval_every, checkpoint_every   in those steps (and at the last one)
  train.checkpoint_minutes   a checkpoint also when this many minutes passed since the last
                        save (0: off); whichever of it and checkpoint_every comes first
  train.keep_checkpoints, train.seed
  train.max_consecutive_skipped   updates skipped in a row (non-finite loss, gradients or
                        updated state) that stop a run as diverged, naming its last good checkpoint
SIGTERM or SIGINT (a scheduler's preemption, Ctrl-C) ends a run at the next step boundary with a
checkpoint; `python -m k25jax.main` then exits 143 (k25jax/train/preemption.py).

Lengths that follow the run: every length measured in the run's steps (the optimizer's warmup
and decay, evaluation and checkpoint cadence, Toggle's phase, PARL's λ anneal, the ViT stage's
second phase) is the preset's value while it fits the run, and the same share of the run when
`train.steps` is set shorter (`fit_to_run`, `schedule_fit_to_run`): `--config.train.steps=N`
runs for any N >= 1. A length set itself (`--config.optimizer.warmup_steps=N`) is taken as
given; the stage's config check names it in one line when the run cannot hold it.
"""
import dataclasses

import ml_collections

from k25jax.model import config as model_config

# The tiny chat model of the sft and rl_vision stages: a ~0.5M-param K2 decoder over the
# chat vocabulary (bytes, media, role and tool tokens: 268 ids, `k25jax.data.legacy_chat`), long
# enough for the zero-vision trajectories and a few tool turns.
CHAT_VOCAB_SIZE = 268
K25_FORMAT_VOCAB_SIZE = 275   # the K2.5 chat format over bytes (k25jax.data.tokenizer.ByteTokenizer(media, chat))
TINY_CHAT_TEXT = dict(vocab_size=CHAT_VOCAB_SIZE, hidden_size=128, intermediate_size=256, moe_intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4, n_routed_experts=4, num_experts_per_tok=2,
                      q_lora_rank=64, kv_lora_rank=64, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=32,
                      max_position_embeddings=512)

# The synthetic vision tasks (`k25jax.data.visual_synthetic.TASKS`).
VISUAL_TASKS = ("caption", "count", "read", "chart", "motion")


def _min(a, b):
  """min(a, b) for integers or ml_collections FieldReferences (their public arithmetic)."""
  return (a + b - abs(a - b)) // 2


def _max(a, b):
  """max(a, b) for integers or FieldReferences."""
  return (a + b + abs(a - b)) // 2


def _fits(needed, available):
  """1 where needed <= available, else 0 (integers or FieldReferences)."""
  return _min(1, _max(0, available - needed + 1))


def fit_to_run(length: int, steps, preset_steps: int, *, at_least: int = 0):
  """A length of the preset's run (`preset_steps` long) that follows the run's `steps` (a
  FieldReference, e.g. `c.train.get_ref("steps")`), recomputed whenever train.steps is set:

      L(T) = L                                       L <= T  (it fits: the preset's value)
           = max(at_least, ⌊L · T / preset_steps⌋)   L >  T  (the preset's share of the run)
  """
  fits = _fits(length, steps)
  return fits * length + (1 - fits) * _max(at_least, steps * length // preset_steps)


def schedule_fit_to_run(section: ml_collections.ConfigDict, updates) -> None:
  """The optimizer `section`'s warmup and decay follow the run's `updates` (a FieldReference):
  the preset's values while warmup + decay <= updates, else each scaled by
  updates / (warmup + decay), so that together they fit."""
  warmup, decay = section.warmup_steps, section.decay_steps
  fits = _fits(warmup + decay, updates)
  scaled = lambda part: updates * part // max(warmup + decay, 1)
  section.warmup_steps = fits * warmup + (1 - fits) * scaled(warmup)
  section.decay_steps = fits * decay + (1 - fits) * scaled(decay)


def cadence_fit_to_run(train: ml_collections.ConfigDict) -> None:
  """`train.eval_every` and `checkpoint_every` (where the section has them) follow `train.steps`
  (`fit_to_run`, at least 1); the loop also evaluates and saves at the last step."""
  steps, preset_steps = train.get_ref("steps"), train.steps
  for name in ("eval_every", "checkpoint_every"):
    if name in train:
      train[name] = fit_to_run(train[name], steps, preset_steps, at_least=1)


def follow_the_run(c: ml_collections.ConfigDict, updates=None) -> None:
  """The config's optimizer schedule (over `updates`, default train.steps) and cadences follow
  `train.steps` (`schedule_fit_to_run`, `cadence_fit_to_run`). Called last in `get_config`, once
  the preset has set its lengths."""
  schedule_fit_to_run(c.optimizer, c.train.get_ref("steps") if updates is None else updates)
  cadence_fit_to_run(c.train)


def rl_follow_the_run(c: ml_collections.ConfigDict) -> None:
  """An RL stage's lengths that follow the run: the policy's schedule over train.steps ×
  rl.minibatches updates and its cadences (`follow_the_run`), and the built-in warm start's
  schedule and cadence over warm_start.steps, where the config has one."""
  follow_the_run(c, updates=c.train.get_ref("steps") * c.rl.get_ref("minibatches"))
  if "warm_start" in c:
    schedule_fit_to_run(c.warm_start.optimizer, c.warm_start.get_ref("steps"))
    cadence_fit_to_run(c.warm_start)


def preset_and_switches(arg, path: str, presets: tuple[str, ...], switches: tuple[str, ...] = ()
                        ) -> tuple[str, set[str]]:
  """`arg` = "preset[,switch,...]" (default: the first preset) → (preset, switches); an
  unknown name fails, naming the config file."""
  parts = (arg or presets[0]).split(",")
  preset, chosen = parts[0], set(parts[1:])
  if preset not in presets:
    raise ValueError(f"{path}: unknown preset {preset!r}; choose from {presets}")
  if chosen - set(switches):
    raise ValueError(f"{path}: unknown switches {sorted(chosen - set(switches))}; known: {switches}")
  return preset, chosen


def model_section(preset: str, **overrides) -> ml_collections.ConfigDict:
  """The `model` section of a text-only stage: the preset's name and every `ModelConfig`
  field at the preset's value (so `--config.model.num_hidden_layers=2` overrides one field
  and a misspelt field fails)."""
  fields = dataclasses.asdict(model_config.preset(preset, **overrides))
  return ml_collections.ConfigDict({"preset": preset, **fields})


def k25_model_section(preset: str, **text_overrides) -> ml_collections.ConfigDict:
  """The `model` section of a K2.5 stage: every `ModelConfig` field under `text`, every
  `VisionConfig` field under `vision`, and the projector's LayerNorm eps."""
  cfg = model_config.k25_preset(preset)
  text = dataclasses.asdict(cfg.text.replace(**text_overrides))
  vision = dataclasses.asdict(cfg.vision)
  return ml_collections.ConfigDict({"preset": preset, "text": text, "vision": vision,
                                    "projection_layer_norm_eps": cfg.projection_layer_norm_eps})


def init_section(k25: bool = False) -> ml_collections.ConfigDict:
  """Where a fresh run starts (module docstring)."""
  fields = dict(checkpoint="", hf_checkpoint="")
  if k25:
    fields["text_checkpoint"] = ""
  return ml_collections.ConfigDict(fields)


def optimizer_section(lr: float, warmup_steps: int, decay_steps: int, *, name: str = "adamw",
                      weight_decay: float = 0.0, b2: float = 0.95, grad_clip: float = 1.0
                      ) -> ml_collections.ConfigDict:
  """An `optimizer` section under the warmup–stable–decay schedule (`k25jax/train/optimizer.py`),
  with every field of both optimizers, so `--config.optimizer.name` switches between them."""
  return ml_collections.ConfigDict(dict(
      name=name,                           # adamw | muonclip (Muon + QK-Clip, AdamW for the rest)
      lr=lr,
      warmup_steps=warmup_steps,           # warmup → stable → cosine decay (WSD)
      decay_steps=decay_steps,
      final_lr_ratio=0.1,
      b1=0.9,
      b2=b2,
      eps=1e-8,
      weight_decay=weight_decay,
      grad_clip=grad_clip,
      # muonclip only (b1, b2, eps above are its AdamW half's):
      momentum=0.95,                       # Nesterov momentum of Muon
      nesterov=True,
      ns_steps=5,                          # Newton–Schulz iterations
      rms_scale=0.2,                       # Muon update · rms_scale · sqrt(max(rows, cols))
      qk_clip_tau=100.0,                   # QK-Clip threshold τ on the max pre-softmax logit
  ))


def mesh_section(**sizes) -> ml_collections.ConfigDict:
  """Device counts per mesh axis (-1 takes the devices left over); data-parallel by default.
  `devices`: how many devices the mesh spans, the first ones of this process (-1: all)."""
  return ml_collections.ConfigDict({**dict(data=-1, fsdp=1, expert=1, sequence=1, tensor=1, devices=-1), **sizes})


def policy_loss_section() -> ml_collections.ConfigDict:
  """The `loss` section of the RL stages (`k25jax.rl.policy_loss`). `normalize="group"` is Eq. 1's
  1/N: N the tokens of the K = rl.num_generations responses of one prompt (a minibatch holds
  whole groups), the prompts averaged; "batch", the minibatch's token mean, is an ablation."""
  return ml_collections.ConfigDict(dict(
      name="k25",                      # k25 | ppo | grpo | cispo
      alpha=-0.5, beta=0.5, tau=0.01,  # K2.5: band [alpha, beta] on the log ratio, squared log-ratio penalty
      normalize="group",               # group (Eq. 1) | batch (an ablation)
      eps=0.2, eps_high=0.28))         # clip ranges of the ablation losses


def sandbox_section(sessions: int) -> ml_collections.ConfigDict:
  """The sandboxed Python tool (`k25jax.agents.sandbox`): sessions and per-call limits."""
  return ml_collections.ConfigDict(dict(sessions=sessions, cpu_s=2.0, wall_s=10.0, memory_mb=512,
                                        output_chars=120))


def grm_section(**overrides) -> ml_collections.ConfigDict:
  """A generative reward model (`k25jax.rl.grm`): the judge (`checkpoint`: a k25jax workdir or an
  HF folder of a K2.5 model speaking Kimi K2.5's chat format; '' = none), its sampling, the
  verdict grammar (one group: k of k/max_score at the judgement's end), and how `samples`
  judgements of a response make its reward (mean | vote); `reference`: the true answer is in
  the judge's prompt. `max_new_tokens`: configs/grm.py's judgements run to 179 tokens (96 cut
  12% of them short: unparsable)."""
  c = ml_collections.ConfigDict(dict(checkpoint="", samples=1, temperature=1.0, max_new_tokens=192,
                                     verdict=r"Score:\s*(\d+)\s*/\s*10\s*$", max_score=10, aggregate="mean",
                                     reference=False))
  c.update(overrides)
  return c

