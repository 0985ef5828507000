"""Stages on two processes (jax.distributed over localhost, gloo CPU collectives, 2 devices
each) train exactly as on one process with 4 devices: joint pre-training, with its media
sharded with the rows; and vision RL with Toggle (the sampler's tool rollouts and Toggle's
budgets, image prompts encoded on the mesh, the K2.5 loss with the images laid out as
`multimodal.to_device` lays out every replicated-media batch, the evaluation) from an SFT
start trained once, here: after tens of steps two runs of it differ by float noise, and
sampling at T = 1 turns that into different tokens. Three stages ran here too and are stood
for: text RL with Toggle (its sampler, Toggle and driver are the ones vision RL runs); the ViT
stage (its batches are joint pre-training's mixture at a vision share of 1 and its step the
same media-sharded step; its phase switch is tested on one process, test_stage_multimodal.py);
and zero-vision SFT with visual examples (its step is the trainer's step on batches laid out
by `multimodal.to_device`, as vision RL's updates are, with joint pre-training's `Trainer.fit`
around it; its held-out tool rollouts with the image are vision RL's `tool_rollout.play`
through the vision decoder, and its host-side batches are a pure function of the step). Its
micro config still passes the stage's checks here, and trains vision RL's start.

The three processes (`single`: one process, 4 devices; process 0 and 1; LLVM at its quickest
level, cpu_env.COMPILE_BOUND_FLAGS; process 1 loads the programs process 0 compiled,
cpu_env.compile_once_for_both_processes) start once and run the stages in turn, each into its
own workdir and metrics file; a test per stage
compares them: every logged metric, and the params of the last checkpoint (the pair's saved
by both processes together). Run as a script, this file is one such worker.
"""
import os
import re
import subprocess
import sys

import numpy as np
import pytest
import saved_states
from cpu_env import compile_once_for_both_processes, free_port, xla_flags

MICRO_TEXT = dict(vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                  num_hidden_layers=2, num_attention_heads=2, n_routed_experts=4, num_experts_per_tok=2,
                  q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)
STEPS = 2


def stage_config(stage: str, init: str = ""):
  """Micro configs of the stages the workers run (joint pre-training: media in 4 shards, one
  per data shard) and of vision RL's SFT start; `init`: the RL run's init.checkpoint."""
  from config_files import load_config
  from configs import common
  if stage == "sft":         # vision RL's start (`sft_start`): direct answers to counting questions
    config = load_config("configs/sft.py", "tiny,visual")
    config.model.text.update(MICRO_TEXT, max_position_embeddings=384)
    config.model.vision.num_hidden_layers = 1
    config.data.update(trajectories=32, visual_examples=256, kinds="count")
    config.train.update(steps=40, batch=8, visual_batch=8, log_every=40, checkpoint_every=40)
    config.optimizer.update(lr=3e-3, warmup_steps=5, decay_steps=20)
    config.sandbox.sessions = 4
    config.eval.update(tasks=4, max_turns=1, max_context=320, turn_tokens=8, settings="image_no_tool")
    return config
  if stage == "rl_vision":   # image prompts, tool rollouts, Toggle, the K2.5 loss with the images
    config = load_config("configs/rl.py", "vision,toggle")
    config.model.text.update(MICRO_TEXT, max_position_embeddings=256)
    config.model.vision.num_hidden_layers = 1
    config.init.checkpoint = init
    config.task.update(train_prompts=8, eval_prompts=4, kinds="count")
    config.toggle.update(m=1, budget_samples=2)
    config.rl.update(prompts_per_iteration=2, num_generations=4, minibatches=1, max_turns=2, max_context=192,
                     turn_tokens=8, eval_samples=1)
    config.train.update(steps=STEPS, eval_every=STEPS, log_every=1, checkpoint_every=STEPS)
    config.optimizer.update(warmup_steps=1)
    config.sandbox.sessions = 8
    config.mesh.update(data=2, fsdp=2)
    return config
  config = load_config("configs/pretrain.py", "joint")
  config.data.update(shard_media=True, max_patches=512, vision_ratio=0.3, vision_eval_batches=1,
                     vision_tasks=("count", "motion"))
  config.model = common.k25_model_section("tiny", **MICRO_TEXT)
  config.mesh.update(data=2, fsdp=2)
  config.optimizer.update(warmup_steps=1, decay_steps=1)
  config.train.update(steps=STEPS, batch=8, seq_len=96, log_every=1, eval_every=STEPS, eval_batches=1,
                      checkpoint_every=STEPS, keep_checkpoints=1)
  return config


def run_stage(stage: str, workdir: str, init: str) -> dict[str, np.ndarray]:
  """Every logged train and eval metric of the stage's run, by split and name."""
  from k25jax.stages import pretrain, rl_vision
  _, history = {"joint": pretrain, "rl_vision": rl_vision}[stage].run(stage_config(stage, init), workdir)
  out = {}
  for record in history:
    for name, value in record.items():
      if isinstance(value, (int, float)) and not re.search(r"step$|seconds|_s$|per_s", name):
        out.setdefault(f"{record['split']}/{name}", []).append(float(value))
  return {name: np.asarray(values) for name, values in out.items()}


def sft_start(workdir: str) -> None:
  """A K2.5 start for the rl_vision runs: the micro SFT model after 40 steps of direct
  answers to counting questions (greedy accuracy ~0.4, so groups get different rewards),
  on the process's devices."""
  from k25jax.stages import sft
  sft.run(stage_config("sft"), workdir)


STAGES = ("joint", "rl_vision")      # what the workers run
WORKERS = (("single", 4), ("0", 2), ("1", 2))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  """The metrics of every stage on every worker, {(who, stage): {name: values}}, and the
  workdirs of the one-process run and of the pair: vision RL's SFT start (trained here, in a
  one-device process) first, then the three workers
  started together, compiling at LLVM's quickest level (each stage runs two steps)."""
  tmp = tmp_path_factory.mktemp("multiprocess")
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(__file__), env.get("PYTHONPATH", "")])
  sft_init = str(tmp / "sft")
  start = subprocess.run([sys.executable, __file__, "sft_start", sft_init], env=dict(env, XLA_FLAGS=xla_flags()),
                         capture_output=True, text=True, timeout=900)
  assert start.returncode == 0, start.stderr[-3000:]
  port = free_port()
  workers = [subprocess.Popen([sys.executable, __file__, who, str(port), str(tmp), sft_init],
                              env=dict(env, XLA_FLAGS=xla_flags(devices, compile_bound=True)),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for who, devices in WORKERS]
  outputs = [w.communicate(timeout=1800)[0] for w in workers]
  for w, out in zip(workers, outputs):
    assert w.returncode == 0, out[-3000:]
  metrics = {(who, stage): dict(np.load(tmp / f"{who}_{stage}.npz")) for who, _ in WORKERS for stage in STAGES}
  return metrics, {who: str(tmp / who) for who in ("single", "pair")}


def final_params(workdir: str) -> dict[str, np.ndarray]:
  """The params of the run's newest checkpoint by path, restored onto one device whatever mesh saved them."""
  from k25jax.train import checkpoint
  return saved_states.by_key_path(checkpoint.restore_params(workdir, saved_states.one_device_target(workdir)["params"]))


@pytest.mark.parametrize("stage", ("joint", "sft", "rl_vision"))
def test_the_micro_configs_pass_their_stages_checks(stage):
  """What the workers and the SFT start run are valid runs of their stages: fields and the stage's own check."""
  from k25jax.stages import pretrain, rl_vision, sft
  from k25jax.train import config_check
  config = stage_config(stage, init="/a/warm_start")
  config_check.validate(config)
  {"joint": pretrain, "sft": sft, "rl_vision": rl_vision}[stage].check(config)


@pytest.mark.slow
@pytest.mark.parametrize("stage", STAGES)
def test_two_processes_match_one(runs, stage):
  metrics, workdirs = runs
  single = metrics["single", stage]
  assert len(single["train/loss"]) == STEPS
  if stage == "rl_vision":      # groups with different rewards: a policy gradient to agree on; both Toggle phases
    assert 0 < single["train/reward"].min() and single["train/reward"].max() < 1 and single["train/grad_norm"].min() > 1e-2
    assert list(single["train/toggle_phase"]) == [0, 1]
  else:
    assert single["train/grad_norm"].min() > 0 and single["train/skipped_steps"].max() == 0
  if stage == "joint":      # answers of images that the tower encoded in their shards
    assert single["train/answer_count"].min() > 0 and "eval/vision_loss" in single
  for who in ("0", "1"):
    got = metrics[who, stage]
    assert sorted(got) == sorted(single)
    for name, values in single.items():     # sampled tokens and rewards equal; float noise of the collectives
      np.testing.assert_allclose(got[name], values, rtol=1e-4, atol=1e-5, err_msg=f"process {who}: {name}")
    if stage == "joint":
      np.testing.assert_allclose(got["train/loss"], single["train/loss"], rtol=1e-5)
  reference = final_params(os.path.join(workdirs["single"], stage))
  pair = final_params(os.path.join(workdirs["pair"], stage))
  assert sorted(pair) == sorted(reference)
  for name, value in reference.items():
    np.testing.assert_allclose(pair[name], value, rtol=1e-4, atol=2e-5, err_msg=name)


if __name__ == "__main__":     # `sft_start WORKDIR`, or a worker: `WHO PORT ROOT SFT_INIT`
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  import jax
  jax.config.update("jax_default_matmul_precision", "highest")
  if sys.argv[1] == "sft_start":
    sft_start(sys.argv[2])
    sys.exit(0)
  who, port, root, sft_init = sys.argv[1], int(sys.argv[2]), *sys.argv[3:5]
  if who != "single":
    compile_once_for_both_processes()
    jax.distributed.initialize(f"localhost:{port}", num_processes=2, process_id=int(who))
  assert jax.device_count() == 4, jax.device_count()
  for stage_name in STAGES:
    workdir = os.path.join(root, "single" if who == "single" else "pair", stage_name)
    np.savez(os.path.join(root, f"{who}_{stage_name}.npz"), **run_stage(stage_name, workdir, sft_init if stage_name == "rl_vision" else ""))
