# python experiments/recipe.py --out=experiments/results/recipe
"""The K2.5 recipe on ONE tiny model: the config of every stage, in order, each with the same
model section. Not a stage config: `experiments/recipe.py` runs the stages one after the other,
each starting from the previous one's workdir (`init`), and probes the model after each.

    text_pretrain   configs/pretrain.py:tiny          the decoder alone, next-token on text
    vit             configs/vit.py                    MoonViT-3D + projector, the decoder frozen
    joint_pretrain  configs/pretrain.py:joint         10:90 vision:text tokens
    midtrain        configs/midtrain.py               long rows with YaRN
    sft             configs/sft.py:tiny,arithmetic    zero-vision SFT (+ 6,000 addition chats; replay of
                                                      pre-training: 500 rows of its text, 3,000 joint
                                                      pre-training image samples; no SFT data with images)
    joint_rl        configs/rl.py:joint,toggle,       RL on text and image tasks by ability, Toggle on; open
                    describe                          descriptions of scenes (no SFT example has one: what
                                                      the model knows of them is pre-training's captions)
                                                      rewarded by the recipe's judge
    parl            configs/parl.py:tiny,chat         the agent swarm in the chat format: the decoder
                                                      fine-tuned on the scripted demonstrations
                                                      (warm_start.after_init, 200 steps at lr 3e-4), then 24
                                                      PARL iterations (the stand-alone run has 80)

The judge of joint RL's generative reward model is a model of its own, trained beside the
chain before joint RL (`judge_config`: configs/grm.py, SFT on judgements of descriptions). It
speaks Kimi K2.5's chat format; in the legacy format it starts from a fresh init (its 275 ids
are not the chain's 268), in the K2.5 format it is the chain's model, from mid-training's run.

The model is the tiny chat model of configs/sft.py (`common.TINY_CHAT_TEXT`: hidden 128, 2
layers; the tiny MoonViT-3D): the byte tokenizer with media tokens of the pre-training stages
is a prefix of the chat tokenizer's ids (268 ids: k25jax's legacy chat tokens; 275 with the
`k25_format` switch: Kimi K2.5's chat tokens), so one vocabulary serves all.
The text stage and PARL train the decoder alone (`model_section`; PARL's tasks are text, and
the K2.5 model after it is joint RL's with PARL's decoder), the others the K2.5 model.
Every stage optimises with MuonClip (Muon + QK-Clip on the decoder), as in the paper.
Mid-training stretches the context 4x over the model's 512 positions (YaRN, 2,048); the
stages after it keep that rope (`experiments/recipe.py` carries it on).

Switch `k25_format` (`configs/recipe.py:tiny,k25_format`, `experiments/recipe.py --k25_format`):
SFT, joint RL and PARL read and write Kimi K2.5's chat format (configs/sft.py, rl.py and
parl.py with their `k25_format` switches: tools declared in a `tool_declare` turn, calls in
tool-call sections, results as tool turns), so that what the chain trains is what Kimi's
template serves; PARL's warm start then draws RL's budgets (3-10), whose demonstrations fit
the 2,048 positions.

Presets: `tiny` (default; the experiment, about an hour on 2 cores) and `test` (a smaller
model and a few steps a stage: the chain test, tests/test_recipe.py).
"""
import ml_collections

from configs import common, grm, midtrain, parl, pretrain, rl, sft, vit

STAGES = ("text_pretrain", "vit", "joint_pretrain", "midtrain", "sft", "joint_rl", "parl")
K25_STAGES = STAGES[1:-1]    # the stages of the K2.5 model (text_pretrain and parl train the decoder alone)
JUDGE = "judge"              # the workdir of joint RL's judge, beside the stages'
JUDGE_STARTS_FROM = "midtrain"   # the K2.5-format recipe's judge starts from this stage's run (`judge_config`)

# The test preset's model: one layer each, narrower (every stage a few seconds).
TEST_TEXT = dict(common.TINY_CHAT_TEXT, hidden_size=64, intermediate_size=128, moe_intermediate_size=64,
                 num_hidden_layers=1, q_lora_rank=32, kv_lora_rank=32, max_position_embeddings=384)


def model_section(k25: bool, preset: str, k25_format: bool = False) -> ml_collections.ConfigDict:
  """The recipe's model: the K2.5 model's section, or its decoder's alone; its vocabulary the
  legacy chat tokenizer's (268 ids) or, with `k25_format`, the byte tokenizer with Kimi K2.5's
  chat tokens (275 ids)."""
  text = dict(common.TINY_CHAT_TEXT if preset == "tiny" else TEST_TEXT,
              vocab_size=common.K25_FORMAT_VOCAB_SIZE if k25_format else common.CHAT_VOCAB_SIZE)
  if not k25:
    return common.model_section("tiny", **text)
  section = common.k25_model_section("tiny", **text)
  if preset == "test":
    section.vision.num_hidden_layers = 1
  return section


def stage_configs(preset: str, k25_format: bool = False) -> dict[str, ml_collections.ConfigDict]:
  """Each stage's config (STAGES order), its model the recipe's and `init` empty; the chat
  stages in k25jax's legacy chat format or, with `k25_format`, in Kimi K2.5's."""
  k25 = ",k25_format" if k25_format else ""
  configs = {"text_pretrain": pretrain.get_config("tiny"), "vit": vit.get_config("tiny"),
             "joint_pretrain": pretrain.get_config("joint"), "midtrain": midtrain.get_config("tiny"),
             "sft": sft.get_config("tiny,arithmetic" + k25), "joint_rl": rl.get_config("joint,toggle,describe" + k25),
             "parl": parl.get_config("tiny," + ("k25_format" if k25_format else "chat"))}
  for name, c in configs.items():
    c.model = model_section(name in K25_STAGES, preset, k25_format)
    c.init.checkpoint = ""
    c.optimizer.name = "muonclip"     # as in the paper: text pre-training's default is AdamW
  s = configs["sft"]
  # Against forgetting pre-training: 500 rows of its text and 3,000 of joint pre-training's image
  # samples (4 rows a step beside the 16 of SFT data); twice the addition chats, so that
  # addition keeps its share of the rows beside the replay.
  s.data.update(text_replay=500, vision_replay=3000, arithmetic_examples=6000)
  s.train.visual_batch = 4
  configs["joint_rl"].grm.checkpoint = JUDGE    # experiments/recipe.py: <root>/judge (`judge_config`)
  p = configs["parl"]
  p.warm_start.update(after_init=True, steps=200)   # the demonstrations fine-tune the chain's model
  # at a tenth of configs/parl.py's lr: the same Item-F1 after the warm start (0.627 at 3e-4 and 3e-3),
  # and far less of what earlier stages taught lost (held-out text loss 2.74 against 6.81, addition
  # 0.906 against 0.000; measured from the recipe's joint RL checkpoint)
  p.warm_start.optimizer.lr = 3e-4
  p.train.update(steps=24, eval_every=24, checkpoint_every=24)   # of configs/parl.py:tiny,chat's 80,
  p.parl.anneal_steps = 12                                       # the λ anneal at half, as there
  if k25_format:
    # Kimi K2.5's format over bytes is ~5x the legacy chat's ids: demonstrations of budgets up to
    # 16 run to ~2,440 ids, past mid-training's 2,048 positions; RL's budgets (3-10) stay under
    # ~1,750 (`widesearch.demonstrations`, 6,000 episodes, seeds 0-2).
    p.warm_start.budget_range = p.parl.budget_range
  text = configs["text_pretrain"].model
  configs["midtrain"].long_context.original_context = text.max_position_embeddings
  if preset == "test":
    shrink(configs, k25_format)
  return configs


def judge_config(preset: str, k25_format: bool = False) -> ml_collections.ConfigDict:
  """The judge of joint RL's descriptions: configs/grm.py (the test preset: configs/grm.py:test,
  a one-layer judge trained two steps). With `k25_format` the judge is the chain's own model
  (the same vocabulary and format), fine-tuned from mid-training's checkpoint (JUDGE_STARTS_FROM,
  experiments/recipe.py sets `init`) with its rope, so that it starts knowing the captions' words;
  in the legacy format it starts from a fresh init (its 275 ids are not the chain's 268)."""
  config = grm.get_config(preset)
  if k25_format:
    config.model = model_section(True, preset, k25_format)
  return config


def shrink(configs: dict[str, ml_collections.ConfigDict], k25_format: bool) -> None:
  """The test preset: two steps (one RL iteration) a stage on short rows, small evaluations; in
  Kimi K2.5's format YaRN stretches mid-training's 128 positions 12x, for PARL's contexts (the
  test's demonstrations run to ~1,100 ids)."""
  short = dict(steps=2, log_every=1, eval_every=2, checkpoint_every=2)
  for name in ("text_pretrain", "vit", "joint_pretrain"):
    configs[name].train.update(short, batch=8, seq_len=96, eval_batches=1)
  configs["vit"].vit.projector_only_from = 1
  configs["joint_pretrain"].data.update(vision_eval_batches=1, max_patches=256)
  configs["vit"].data.max_patches = 256
  mid = configs["midtrain"]
  mid.train.update(short, seq_len=256, eval_batches=1)
  mid.long_context.update(original_context=128, yarn_factor=12.0 if k25_format else 4.0)
  mid.data.update(max_doc_chars=1000, max_patches=256)
  s = configs["sft"]
  s.data.update(trajectories=32, arithmetic_examples=32, text_replay=8, vision_replay=32)
  # (Kimi K2.5's rows are twice as long, 640 tokens: the 32 image samples pack into 4 rows)
  s.train.update(steps=2, batch=8, visual_batch=4 if k25_format else 8, log_every=1, checkpoint_every=2)
  s.sandbox.sessions = 4
  s.eval.update(tasks=2, max_turns=1, max_context=320, turn_tokens=8, settings="text_tool")
  r = configs["joint_rl"]
  r.task.update(train_prompts=16, eval_prompts=4)
  r.rl.update(prompts_per_iteration=2, num_generations=4, minibatches=1, max_turns=1, max_context=192,
              turn_tokens=8, eval_samples=1)
  r.train.update(steps=1, eval_every=1, log_every=1, checkpoint_every=1)
  r.toggle.enabled = False
  r.sandbox.sessions = 4
  r.grm.update(samples=1, max_new_tokens=16)
  p = configs["parl"]
  p.warm_start.update(demonstrations=16, steps=2, batch=8, log_every=1, checkpoint_every=2)
  p.warm_start.optimizer.update(warmup_steps=1, decay_steps=1)
  p.rl.update(prompts_per_iteration=2, num_generations=4, minibatches=1)
  p.parl.update(eval_tasks=2, n_range=(2, 6), hops_range=(4, 5), budget_range=(3, 5), anneal_steps=1,
                orchestrator_turn_tokens=40, subagent_turn_tokens=20)
  p.train.update(steps=1, eval_every=1, log_every=1, checkpoint_every=1)
  for name, c in configs.items():
    c.optimizer.update(warmup_steps=1, decay_steps=0 if name in ("joint_rl", "parl") else 1)


def get_config(arg=None) -> ml_collections.ConfigDict:
  """{stage: config} of `arg` = tiny | test [,k25_format], in STAGES order."""
  preset, switches = common.preset_and_switches(arg, "configs/recipe.py", ("tiny", "test"), ("k25_format",))
  return ml_collections.ConfigDict(stage_configs(preset, "k25_format" in switches))
