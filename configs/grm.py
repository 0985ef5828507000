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
"""
from configs import common, sft


def get_config(arg=None):
  common.preset_and_switches(arg, "configs/grm.py", ("tiny",))
  c = sft.get_config("tiny,files")
  c.data.update(source="judgements", judgements=12000, eval_judgements=128, max_length=480)
  c.train.update(steps=2000, visual_batch=16,   # every judge chat has an image: visual_batch rows a step
                 eval_every=250, log_every=50, checkpoint_every=500)
  c.optimizer = common.optimizer_section(3e-3, 50, 1950, name="muonclip")
  c.grm = common.grm_section(samples=4)
  c.eval.update(judge_tasks=128, judge_samples="1,4,8")
  common.follow_the_run(c)
  return c
