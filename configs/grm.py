# python -m k25jax.main --config=configs/grm.py --workdir=runs/grm
"""The judge of the generative reward model (`k25jax.rl.grm`): SFT of the tiny K2.5 model on
judgements of descriptions of synthetic scenes (`k25jax.data.judgements`).

`get_config("tiny")`: the K2.5 model of configs/sft.py:tiny,files (the byte tokenizer with the
K2.5 chat tokens, 275 ids; the tiny MoonViT-3D) fine-tuned on `data.judgements` chats: the
image, the task, a description with 0–4 errors (a colour, shape or quadrant changed, an object
left out or made up, the count wrong), and the judgement to write: the errors in short, then
`Score: k/10` with k the hidden rubric out of 10 (`k25jax.data.descriptions`). Held-out loss
and token accuracy every `train.eval_every` steps; at the end the judge against the rubric on
`eval.judge_tasks` held-out descriptions (Spearman, exact and within-one score accuracy),
greedy and with `samples` judgements at `grm.temperature` for each count in
`eval.judge_samples`. `--config.init.checkpoint=DIR` starts from a K2.5 workdir of the same
model (e.g. the recipe's mid-trained one). The workdir is a judge: `grm.checkpoint` of
configs/rl.py:joint,describe.

`get_config("test")`: a one-layer 32-wide judge, two steps on 32 judgements, a small
evaluation (the tests' and the recipe test preset's judge).
"""
from configs import common, sft


MICRO_JUDGE = dict(num_hidden_layers=1, hidden_size=32, q_lora_rank=16, kv_lora_rank=16, intermediate_size=64,
                   moe_intermediate_size=32, num_attention_heads=2, qk_nope_head_dim=8, qk_rope_head_dim=8,
                   v_head_dim=8)


def get_config(arg=None):
  preset, _ = common.preset_and_switches(arg, "configs/grm.py", ("tiny", "test"))
  c = sft.get_config("tiny,files")
  c.data.update(source="judgements", judgements=12000, eval_judgements=128, max_length=480)
  c.train.update(steps=2000, visual_batch=16,   # every judge chat has an image: visual_batch rows a step
                 eval_every=250, log_every=50, checkpoint_every=500)
  c.optimizer = common.optimizer_section(3e-3, 50, 1950, name="muonclip")
  c.grm = common.grm_section(samples=4)
  c.eval.update(judge_tasks=128, judge_samples="1,4,8")
  if preset == "test":
    c.model.text.update(MICRO_JUDGE)
    c.model.vision.num_hidden_layers = 1
    c.data.update(judgements=32, eval_judgements=8)
    c.train.update(steps=2, visual_batch=8, eval_every=2, log_every=1, checkpoint_every=2)
    c.optimizer.update(warmup_steps=1, decay_steps=1)
    c.eval.update(judge_tasks=4, judge_samples="1")
    c.grm.max_new_tokens = 16
  common.follow_the_run(c)
  return c
