"""Stages on two processes (jax.distributed over localhost, gloo CPU collectives, 2 devices
each) train exactly as on one process with 4 devices: joint pre-training with its media
sharded with the rows, and RL with Toggle (the
sampler's rollouts and budgets, the policy updates and the evaluation, from one warm start
trained here: after hundreds of steps two runs of it differ by float noise, and sampling at
T = 1 turns that into different tokens).

Run as a script, this file is one worker: `single` (one process, 4 devices) or process 0/1.
"""
import os
import re
import socket
import subprocess
import sys

import numpy as np
import pytest

MICRO_TEXT = dict(vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                  num_hidden_layers=2, num_attention_heads=2, n_routed_experts=4, num_experts_per_tok=2,
                  q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)
STEPS = 2


def stage_config(stage: str, init: str = ""):
  """Micro configs of the joint (media in 4 shards, one per data shard) and RL stages;
  `init`: the RL run's init.checkpoint."""
  from config_files import load_config
  from configs import common
  if stage == "rl":
    config = load_config("configs/rl.py", "tiny,toggle,compact")    # the warm start answers some prompts right
    config.warm_start.update(demonstrations=4096, steps=250, batch=64, log_every=250, checkpoint_every=250)
    config.warm_start.optimizer.update(warmup_steps=10, decay_steps=50)
    config.init.checkpoint = init
    config.optimizer.update(warmup_steps=1)
    config.task.update(train_prompts=64, eval_prompts=8)
    config.rl.update(prompts_per_iteration=8, num_generations=4, eval_samples=1)
    config.toggle.update(m=1, budget_samples=2)
    config.mesh.update(data=2, fsdp=2)
    config.train.update(steps=STEPS, log_every=1, eval_every=STEPS, checkpoint_every=STEPS)
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
  from k25jax.stages import pretrain, rl
  _, history = {"joint": pretrain, "rl": rl}[stage].run(stage_config(stage, init), workdir)
  out = {}
  for record in history:
    for name, value in record.items():
      if isinstance(value, (int, float)) and not re.search(r"step$|seconds|_s$|per_s", name):
        out.setdefault(f"{record['split']}/{name}", []).append(float(value))
  return {name: np.asarray(values) for name, values in out.items()}


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


@pytest.mark.slow
@pytest.mark.parametrize("stage", ["joint", "rl"])
def test_two_processes_match_one(tmp_path, stage):
  init = "-"
  if stage == "rl":
    from k25jax.stages import rl
    config = stage_config("rl")
    config.mesh.update(data=-1, fsdp=1)
    init = rl.shared_warm_start(config, str(tmp_path / "warm_start"))
  port = free_port()
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(__file__), env.get("PYTHONPATH", "")])
  jobs = [("single", 4, tmp_path / "single"), ("0", 2, tmp_path / "pair"), ("1", 2, tmp_path / "pair")]
  workers = [subprocess.Popen([sys.executable, __file__, stage, who, str(port), str(workdir), str(tmp_path / f"{who}.npz"), init],
                              env=dict(env, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}"),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for who, devices, workdir in jobs]
  outputs = [w.communicate(timeout=600)[0] for w in workers]
  for w, out in zip(workers, outputs):
    assert w.returncode == 0, out[-3000:]
  single = dict(np.load(tmp_path / "single.npz"))
  assert len(single["train/loss"]) == STEPS
  if stage == "rl":      # groups with different rewards: a policy gradient to agree on
    assert 0 < single["train/reward"].min() and single["train/reward"].max() < 1 and single["train/grad_norm"].min() > 1e-2
  else:
    assert single["train/grad_norm"].min() > 0 and single["train/skipped_steps"].max() == 0
  if stage == "joint":
    assert single["train/answer_count"].min() > 0 and "eval/vision_loss" in single
  for who in ("0", "1"):
    got = dict(np.load(tmp_path / f"{who}.npz"))
    assert sorted(got) == sorted(single)
    for name, values in single.items():     # sampled tokens and rewards equal; float noise of the collectives
      np.testing.assert_allclose(got[name], values, rtol=1e-4, atol=1e-5, err_msg=f"process {who}: {name}")


if __name__ == "__main__":
  stage_name, who, port, workdir, out, init_dir = sys.argv[1:3] + [int(sys.argv[3])] + sys.argv[4:7]
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  import jax
  jax.config.update("jax_default_matmul_precision", "highest")
  if who != "single":
    jax.distributed.initialize(f"localhost:{port}", num_processes=2, process_id=int(who))
  assert jax.device_count() == 4, jax.device_count()
  np.savez(out, **run_stage(stage_name, workdir, "" if init_dir == "-" else init_dir))
