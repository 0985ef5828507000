"""End-to-end pretrain runs, fed from files (`data.source=files`: the standard library's
documents written as a gzip JSONL and a Parquet file, mixed 3:1 by tokens): loss falls, logs
and checkpoints appear, resume is exact (the files' mixture resumes from the checkpoint with
the state), a corrupt latest checkpoint is quarantined and the run goes on from the previous
one to finish, an unwritable workdir fails clearly, SIGTERM mid-step, mid-evaluation or
mid-save saves and stops at the next step and the rerun ends bit-exact with the uninterrupted
run."""
import glob
import gzip
import json
import logging
import os
import shutil
import signal

import jax
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import shared_runs

from k25jax.data import sources, tokenizer
from k25jax.model import transformer
from k25jax.stages import pretrain
from k25jax.train import checkpoint, config_utils, loop, optimizer, preemption, sharding, trainer as trainer_lib
import sigterm
from test_train_step import micro_config

STEPS, EVERY = 60, 20


def stdlib_corpus() -> str:
  """`data.files` of the standard library's documents (`sources.python_stdlib`) written as a
  user's files once a session: the first half as gzip JSONL, the rest as Parquet; 3:1 by tokens."""
  root = os.path.join(shared_runs.shared_dir(), "e2e_corpus")
  if not os.path.isdir(root):
    docs = sources.python_stdlib(1000)
    staging = f"{root}.tmp{os.getpid()}"
    os.makedirs(staging)
    with gzip.open(os.path.join(staging, "code.jsonl.gz"), "wt", encoding="utf-8") as f:
      f.writelines(json.dumps({"text": d}) + "\n" for d in docs[:len(docs) // 2])
    pq.write_table(pa.table({"text": docs[len(docs) // 2:]}), os.path.join(staging, "more.parquet"))
    os.replace(staging, root)
  return f"{root}/code.jsonl.gz:3,{root}/more.parquet:1"


def config_for_e2e():
  config = micro_config()
  config.data.update(source="files", files=stdlib_corpus())
  config.train.update(steps=STEPS, batch=8, seq_len=32, log_every=10, eval_every=30, eval_batches=2,
                      checkpoint_every=EVERY, keep_checkpoints=5)
  config.optimizer.update(warmup_steps=5, decay_steps=20)
  config.mesh.update(data=2, fsdp=4)               # the 8 test devices
  return config


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
  workdir = str(tmp_path_factory.mktemp("pretrain"))
  state, history = pretrain.run(config_for_e2e(), workdir)
  return workdir, jax.device_get(state), history


@pytest.mark.slow
def test_loss_falls_and_artifacts_appear(full_run):
  workdir, state, history = full_run
  train = [h for h in history if h["split"] == "train"]
  evals = [h for h in history if h["split"] == "eval"]
  assert train[0]["step"] == 1 and int(state.step) == STEPS
  assert train[0]["loss"] > 5.5                     # ≈ ln(512) at init
  assert evals[-1]["loss"] < train[0]["loss"] - 2.0, (train[0]["loss"], evals[-1]["loss"])
  assert glob.glob(os.path.join(workdir, "tensorboard", "events.out.tfevents.*"))
  assert sorted(os.listdir(os.path.join(workdir, "checkpoints"))) == sorted(
      str(s) for s in range(EVERY, STEPS + 1, EVERY))


@pytest.mark.slow
def test_resume_is_exact(full_run, tmp_path):
  workdir, state, _ = full_run
  resumed_dir = str(tmp_path / "resumed")
  shutil.copytree(workdir, resumed_dir)
  for step in range(2 * EVERY, STEPS + 1, EVERY):    # as if killed right after saving step 20
    shutil.rmtree(os.path.join(resumed_dir, "checkpoints", str(step)))
  resumed, history = pretrain.run(config_for_e2e(), resumed_dir)
  assert history[0]["step"] > EVERY                  # it did not start over
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(resumed), state)   # bitwise, rng included


@pytest.mark.slow
def test_corrupt_latest_checkpoint_falls_back(full_run, tmp_path, caplog):
  workdir, state, _ = full_run
  corrupt_dir = str(tmp_path / "corrupt")
  shutil.copytree(workdir, corrupt_dir)
  for path in glob.glob(os.path.join(corrupt_dir, "checkpoints", str(STEPS), "state", "**"), recursive=True):
    if os.path.isfile(path):
      with open(path, "wb") as f:
        f.write(b"\x00garbage")
  config = config_for_e2e()
  model = transformer.Transformer(config_utils.model_config_from(config.model))
  tx = optimizer.make_optimizer(config.optimizer, config.train.steps)
  mesh = sharding.make_mesh(config.mesh.to_dict())
  data, _ = pretrain.datasets(config, tokenizer.ByteTokenizer())
  ckpt = checkpoint.Checkpoints(corrupt_dir, keep=5)
  with jax.set_mesh(mesh), caplog.at_level(logging.WARNING):
    restored = ckpt.restore_latest(trainer_lib.state_target(model, tx, mesh), data)
  ckpt.close()
  assert int(restored.step) == STEPS - EVERY
  warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
  assert len(warnings) == 1 and f"checkpoint {STEPS}" in warnings[0] and "trying the previous one" in warnings[0]
  quarantined = os.path.join(corrupt_dir, "checkpoints_quarantine", str(STEPS))
  assert os.path.isdir(quarantined) and os.listdir(quarantined)                 # nothing deleted
  assert not os.path.exists(os.path.join(corrupt_dir, "checkpoints", str(STEPS)))

  # The run goes on from step 40 and finishes: it saves step 60 again, the same state as before.
  resumed, _ = pretrain.run(config_for_e2e(), corrupt_dir)
  assert os.path.isdir(os.path.join(corrupt_dir, "checkpoints", str(STEPS)))
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(resumed), state)


def test_unwritable_workdir_is_a_clear_error(tmp_path):
  blocker = tmp_path / "a_file"
  blocker.write_text("not a directory")
  with pytest.raises(PermissionError, match="not writable"):
    checkpoint.Checkpoints(str(blocker / "run"), keep=1)


@pytest.mark.slow
def test_export_loads_in_transformers_with_the_runs_logits(full_run, tmp_path):
  """The run's newest params, exported from the workdir alone (k25jax.export), load in
  transformers' DeepseekV3ForCausalLM and give k25jax's logits; exporting the export's own
  load again is bit-exact."""
  import torch
  from transformers import DeepseekV3ForCausalLM
  from k25jax.train import hf_export as export
  from k25jax.convert import hf, safetensors_io
  workdir, state, _ = full_run
  out = export.export(workdir, str(tmp_path / "hf"))
  assert sorted(os.listdir(out)) == ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                                     "tokenizer_config.json"]
  assert json.loads((tmp_path / "hf" / "generation_config.json").read_text()) == {
      "do_sample": False, "bos_token_id": 1, "eos_token_id": 2}
  assert json.loads((tmp_path / "hf" / "config.json").read_text())["architectures"] == ["DeepseekV3ForCausalLM"]
  tokens = np.random.default_rng(0).integers(3, 259, size=(2, 32))
  cfg = config_utils.model_config_from(config_for_e2e().model)
  ours, _ = transformer.Transformer(cfg).apply({"params": state.params}, jax.numpy.asarray(tokens))
  reference = DeepseekV3ForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
  with torch.no_grad():
    theirs = reference(torch.as_tensor(tokens)).logits.numpy()
  np.testing.assert_allclose(theirs, np.asarray(ours), atol=1e-5, rtol=0)
  loaded_cfg, loaded = hf.load(out)
  hf.save(loaded_cfg, loaded, str(tmp_path / "again"))
  first = {n: np.asarray(f.get(n)) for n, f in safetensors_io.iterate(out)}
  again = {n: np.asarray(f.get(n)) for n, f in safetensors_io.iterate(str(tmp_path / "again"))}
  assert sorted(first) == sorted(again)
  for name, value in first.items():
    np.testing.assert_array_equal(again[name], value, err_msg=name)


def test_export_needs_a_runs_workdir(tmp_path):
  from k25jax.train import hf_export as export
  with pytest.raises(FileNotFoundError, match="not the workdir of a k25jax run"):
    export.export(str(tmp_path), str(tmp_path / "out"))


def test_the_byte_tokenizer_exports_as_a_tokenizer_json_transformers_reads(tmp_path):
  """k25jax.convert.hf_tokenizer's tokenizer.json encodes and decodes as ByteTokenizer does,
  read back by transformers' AutoTokenizer; with the chat tokens it carries K2.5's template."""
  from transformers import AutoTokenizer
  from k25jax.convert import hf_tokenizer
  from k25jax.data import chat
  text = "déf f(x):\n  return x ∑ 1 — 你好\t\x00\x7f"
  for media, chat_tokens in ((False, False), (True, False), (True, True)):
    out = tmp_path / f"{media}_{chat_tokens}"
    out.mkdir()
    record = {"name": "bytes", "path": "", "media": media}
    ours = tokenizer.ByteTokenizer(media=media, chat=chat_tokens)
    if chat_tokens:
      hf_tokenizer.byte_tokenizer_json(ours).save(str(out / "tokenizer.json"))
      (out / "tokenizer_config.json").write_text(json.dumps({
          "tokenizer_class": "PreTrainedTokenizerFast", "chat_template": chat.chat_template()}))
    else:
      assert hf_tokenizer.write(record, str(out)) == ["generation_config.json", "tokenizer.json", "tokenizer_config.json"]
    theirs = AutoTokenizer.from_pretrained(str(out))
    assert theirs(text, add_special_tokens=False)["input_ids"] == ours.encode(text)
    assert theirs.decode(ours.encode(text)) == text
    assert {name: theirs.convert_tokens_to_ids(name) for name in ours.special} == ours.special
    assert len(theirs) == ours.vocab_size
  messages = [{"role": "user", "content": "hi"}]
  assert theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == chat.render_text(
      messages, add_generation_prompt=True)
  assert theirs.apply_chat_template(messages, add_generation_prompt=True, return_dict=False) == chat.render_ids(
      ours, messages, add_generation_prompt=True)[0]


def _signal_during(monkeypatch, moment: str) -> int:
  """Sends this process SIGTERM inside the 7th train step, the evaluation at step 30 or the
  save of step 20 (twice there: a second signal while it saves); returns the step the run
  must stop at (the boundary after the signal)."""
  if moment == "mid_step":
    fit, calls = trainer_lib.Trainer.fit, []

    def fit_with_signal(self, state, train_step, *args, **kw):
      def step(s, batch):
        calls.append(1)
        if len(calls) == 7:
          sigterm.send()
        return train_step(s, batch)
      return fit(self, state, step, *args, **kw)

    monkeypatch.setattr(trainer_lib.Trainer, "fit", fit_with_signal)
    return 7
  if moment == "mid_evaluation":
    evaluate = loop.evaluate

    def evaluate_with_signal(*args):
      sigterm.send()
      return evaluate(*args)

    monkeypatch.setattr(loop, "evaluate", evaluate_with_signal)
    return 30
  sigterm.twice_during_save(monkeypatch, 20)
  return 20


@pytest.mark.slow
@pytest.mark.parametrize("moment", ["mid_step", "mid_evaluation", "mid_save"])
def test_sigterm_saves_at_the_next_step_and_the_rerun_ends_as_the_uninterrupted_run(full_run, tmp_path, monkeypatch,
                                                                                    moment):
  workdir, state, history = full_run
  run_dir = str(tmp_path / "run")
  stop_at, handler = _signal_during(monkeypatch, moment), signal.getsignal(signal.SIGTERM)
  with pytest.raises(preemption.Preempted, match=f"^preempted at step {stop_at}: saved to .*checkpoints; rerun the "
                                                 "same command to resume$") as stopped:
    pretrain.run(config_for_e2e(), run_dir)
  assert stopped.value.step == stop_at and str(stop_at) in os.listdir(os.path.join(run_dir, "checkpoints"))
  assert signal.getsignal(signal.SIGTERM) is handler      # the run's handler is gone with it
  monkeypatch.undo()
  resumed, resumed_history = pretrain.run(config_for_e2e(), run_dir)
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(resumed), state)   # bitwise, rng included
  assert resumed_history == [h for h in history if h["step"] > stop_at]          # every logged number
