"""Stages on two processes (jax.distributed over localhost, gloo CPU collectives, 2 devices
each) train exactly as on one process with 4 devices: the ViT stage (both phases) and joint
pre-training, with their media sharded with the rows; RL with Toggle (the sampler's
rollouts and budgets, the policy updates and the evaluation, from one warm start trained
here: after hundreds of steps two runs of it differ by float noise, and sampling at T = 1
turns that into different tokens);
zero-vision SFT with visual examples (the image batches, then tool rollouts with and
without the image); and vision RL from an SFT start trained here (image prompts encoded on
the mesh, the K2.5 loss with the images).

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
  if stage == "sft":         # zero-vision trajectories + visual examples; eval with and without the image
    config = load_config("configs/sft.py", "tiny,visual")
    config.model.text.update(MICRO_TEXT, max_position_embeddings=384)
    config.model.vision.num_hidden_layers = 1
    config.data.update(trajectories=16, visual_examples=16)
    config.train.update(steps=STEPS, batch=4, visual_batch=4, log_every=1, checkpoint_every=STEPS)
    config.optimizer.update(warmup_steps=1, decay_steps=1)
    config.sandbox.sessions = 4
    config.eval.update(tasks=4, max_turns=2, max_context=320, turn_tokens=8, settings="text_tool,image_tool")
    config.mesh.update(data=2, fsdp=2)
    return config
  if stage == "rl_vision":   # image prompts, tool rollouts, the K2.5 loss with the images
    config = load_config("configs/rl.py", "vision")
    config.model.text.update(MICRO_TEXT, max_position_embeddings=256)
    config.model.vision.num_hidden_layers = 1
    config.init.checkpoint = init
    config.task.update(train_prompts=8, eval_prompts=4, kinds="count")
    config.rl.update(prompts_per_iteration=2, num_generations=4, minibatches=1, max_turns=2, max_context=192,
                     turn_tokens=8, eval_samples=1)
    config.train.update(steps=STEPS, eval_every=STEPS, log_every=1, checkpoint_every=STEPS)
    config.optimizer.update(warmup_steps=1)
    config.sandbox.sessions = 8
    config.mesh.update(data=2, fsdp=2)
    return config
  if stage == "vit":         # the tower and projector, then the projector alone (step 2), media in 4 shards
    config = load_config("configs/vit.py")
    config.model = common.k25_model_section("tiny", **MICRO_TEXT)
    config.data.update(shard_media=True, max_patches=512, tasks=("count", "motion"))
    config.vit.projector_only_from = 1
    config.mesh.update(data=2, fsdp=2)
    config.optimizer.update(warmup_steps=1, decay_steps=1)
    config.train.update(steps=STEPS, batch=8, seq_len=96, log_every=1, eval_every=STEPS, eval_batches=1,
                        checkpoint_every=STEPS, keep_checkpoints=1)
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
  from k25jax.stages import pretrain, rl, rl_vision, sft, vit
  stages = {"joint": pretrain, "rl": rl, "sft": sft, "rl_vision": rl_vision, "vit": vit}
  _, history = stages[stage].run(stage_config(stage, init), workdir)
  out = {}
  for record in history:
    for name, value in record.items():
      if isinstance(value, (int, float)) and not re.search(r"step$|seconds|_s$|per_s", name):
        out.setdefault(f"{record['split']}/{name}", []).append(float(value))
  return {name: np.asarray(values) for name, values in out.items()}


def sft_start(workdir: str) -> str:
  """A K2.5 start for the rl_vision runs: the micro SFT model after 40 steps of direct
  answers to counting questions (greedy accuracy ~0.4, so groups get different rewards)."""
  from k25jax.stages import sft
  config = stage_config("sft")
  config.mesh.update(data=-1, fsdp=1)
  config.data.update(trajectories=32, visual_examples=256, kinds="count")
  config.train.update(steps=40, batch=8, visual_batch=8, log_every=40, checkpoint_every=40)
  config.optimizer.update(lr=3e-3, warmup_steps=5, decay_steps=20)
  config.eval.update(tasks=4, max_turns=1, settings="image_no_tool")
  sft.run(config, workdir)
  return workdir


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


@pytest.mark.slow
@pytest.mark.parametrize("stage", ["joint", "vit", "rl", "sft", "rl_vision"])
def test_two_processes_match_one(tmp_path, stage):
  init = "-"
  if stage == "rl":
    from k25jax.stages import rl
    config = stage_config("rl")
    config.mesh.update(data=-1, fsdp=1)
    init = rl.shared_warm_start(config, str(tmp_path / "warm_start"))
  if stage == "rl_vision":
    init = sft_start(str(tmp_path / "sft"))
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
  if stage in ("rl", "rl_vision"):      # groups with different rewards: a policy gradient to agree on
    assert 0 < single["train/reward"].min() and single["train/reward"].max() < 1 and single["train/grad_norm"].min() > 1e-2
  else:
    assert single["train/grad_norm"].min() > 0 and single["train/skipped_steps"].max() == 0
  if stage in ("joint", "vit"):      # answers of images that the tower encoded in their shards
    assert single["train/answer_count"].min() > 0 and ("eval/vision_loss" in single) == (stage == "joint")
  if stage == "sft":     # the held-out rollouts ran with the images encoded on the mesh
    assert "eval/image_tool/accuracy" in single and single["eval/image_tool/generated_tokens"].min() > 0
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
