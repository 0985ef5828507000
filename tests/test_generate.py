"""k25jax.generate: a checkpoint's answers (a workdir's, and the HF folder exported from it) are
the sampler's greedy tokens, streamed one at a time or decoded in batches, in the format the
checkpoint's tokenizer speaks (the legacy chat format of the chat stages, the K2.5 format
with an image, plain text for a pre-training run); the command line gives the same."""
import io
import json
import os
import shutil
import subprocess
import sys

import jax
import numpy as np
import optax
import pytest
from PIL import Image

from configs import common
from cpu_env import subprocess_env
from k25jax import generate
from k25jax.data import chat_formats, legacy_chat, tokenizer
from k25jax.model import k25, media as media_lib, transformer
from k25jax.model.config import ModelConfig
from k25jax.rl import decode, media_rows, sampler
from k25jax.train import config_utils, hf_export, model_record, saved_model, sharding, trainer as trainer_lib

CHECKOUT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEXT = dict(hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2, num_attention_heads=2,
            n_routed_experts=4, num_experts_per_tok=2, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8,
            qk_rope_head_dim=8, v_head_dim=8, max_position_embeddings=256)
GREEDY = sampler.SamplingConfig(max_new_tokens=12, temperature=0.0)


def save_run(workdir: str, model, record: dict | None) -> None:
  """A workdir holding `model`'s random init as checkpoint 0 and its model record."""
  mesh = sharding.make_mesh({"data": 1}, devices=jax.devices()[:1])
  with trainer_lib.Trainer(workdir, model, optax.identity(), mesh=mesh, seed=0, keep_checkpoints=1,
                           tokenizer=record) as trainer:
    trainer.save(0, trainer.start(default_params=lambda: trainer_lib.fresh_params(model, mesh, seed=3)))


@pytest.fixture(scope="module")
def legacy_run(tmp_path_factory):
  """A text model over the legacy chat vocabulary (268 ids), as a workdir and as its export."""
  root = tmp_path_factory.mktemp("legacy")
  model = transformer.Transformer(ModelConfig(**TEXT, vocab_size=legacy_chat.ChatTokenizer().vocab_size))
  save_run(str(root / "run"), model, chat_formats.LEGACY_RECORD)
  hf_export.export(str(root / "run"), str(root / "hf"))
  return str(root / "run"), str(root / "hf")


def greedy_replies(saved: saved_model.SavedModel, prompts: list[list[int]], stop: tuple[int, ...], media=None
                   ) -> list[list[int]]:
  """The sampler's greedy tokens after each prompt, through the stop token: one `sampler.generate`
  call on the prompts right-padded into one batch (`decode.pad`'s layout)."""
  sampling = sampler.SamplingConfig(max_new_tokens=GREEDY.max_new_tokens, temperature=0.0, stop_tokens=stop)
  padded, lengths = decode.pad(prompts, saved.text_cfg, sampling)
  out = jax.device_get(sampler.generate(saved.text_cfg, saved.text_params, padded, lengths, jax.random.PRNGKey(0),
                                        sampling, media=media))
  return [out["tokens"][i, :out["lengths"][i]].tolist() for i in range(len(prompts))]


@pytest.mark.slow
def test_stream_and_batches_are_the_samplers_greedy_tokens_from_the_workdir_and_its_export(legacy_run):
  workdir, folder = legacy_run
  conversations = [[{"role": "user", "content": "12+30="}],
                   [{"role": "user", "content": "what is in the box?"}, {"role": "assistant", "content": "a cat"},
                    {"role": "user", "content": "and now?"}]]
  for path in (workdir, folder):
    saved = saved_model.load(path)
    talker = generate.Talker(saved, GREEDY)
    assert talker.format.name == "legacy" and talker.format.stop_ids == (legacy_chat.ChatTokenizer().end_id,)
    prompts = [talker.format.prompt(c) for c in conversations]
    expected = [talker.format.reply(ids) for ids in greedy_replies(saved, prompts, talker.format.stop_ids)]
    streamed = "".join(talker.stream(conversations[1]))
    assert streamed == expected[1].text and talker.last == expected[1]
    assert talker.complete(conversations) == expected
  assert saved_model.load(workdir).tokenizer.vocab_size == saved_model.load(folder).tokenizer.vocab_size == 268


@pytest.mark.slow
def test_the_chat_keeps_the_conversation_and_stops_at_an_empty_line(legacy_run):
  """Two turns: the second prompt holds the first turn and its answer; an empty line ends the chat."""
  saved = saved_model.load(legacy_run[0])
  talker = generate.Talker(saved, GREEDY)
  first = talker.format.reply(greedy_replies(saved, [talker.format.prompt([{"role": "user", "content": "hi"}])],
                                             talker.format.stop_ids)[0])
  history = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": first.text},
             {"role": "user", "content": "again"}]
  second = talker.format.reply(greedy_replies(saved, [talker.format.prompt(history)], talker.format.stop_ids)[0])
  out = io.StringIO()
  generate.chat_loop(talker, iter(["hi\n", "again\n", "\n", "never read\n"]), out, None, None, once=False)
  marks = [reply.text + ("\n" if reply.error is None else f"\n[{reply.error}]\n") for reply in (first, second)]
  assert out.getvalue() == "".join(marks)


def test_a_pre_training_run_continues_its_prompt(legacy_run, tmp_path):
  """The same model recorded with the plain byte tokenizer (as pre-training records it)."""
  shutil.copytree(legacy_run[0], tmp_path / "run")
  record = tmp_path / "run" / model_record.FILE
  record.write_text(record.read_text().replace('"chat": "legacy"', '"chat": null').replace('"media": true',
                                                                                           '"media": false'))
  saved = saved_model.load(str(tmp_path / "run"))
  talker = generate.Talker(saved, GREEDY)
  assert talker.format.name == "text" and saved.tokenizer.vocab_size == 259
  prompt = talker.format.prompt([{"role": "user", "content": "def f(x):"}])
  assert prompt == [saved.tokenizer.bos_id, *saved.tokenizer.encode("def f(x):")]
  expected = talker.format.reply(greedy_replies(saved, [prompt], (saved.tokenizer.eos_id,))[0])
  assert "".join(talker.stream([{"role": "user", "content": "def f(x):"}])) == expected.text
  with pytest.raises(ValueError, match="no system turn"):
    talker.format.prompt([{"role": "system", "content": "be brief"}, {"role": "user", "content": "x"}])


@pytest.mark.slow
def test_a_k25_checkpoint_answers_about_an_image_in_the_k25_format(tmp_path):
  """The byte vocabulary with the K2.5 chat tokens: the export's tokenizer.json and chat
  template carry them, and the image's features enter at its placeholders."""
  tok = tokenizer.ByteTokenizer(media=True, chat=True)
  model = k25.K25(config_utils.k25_config_from(common.k25_model_section("tiny", **TEXT, vocab_size=tok.vocab_size),
                                               tok))
  save_run(str(tmp_path / "run"), model, {"name": "bytes", "path": "", "media": True, "chat": "k2.5"})
  hf_export.export(str(tmp_path / "run"), str(tmp_path / "hf"))
  image_path = str(tmp_path / "red.png")
  Image.fromarray(np.tile(np.uint8([200, 30, 30]), (56, 56, 1))).save(image_path)
  saved = saved_model.load(str(tmp_path / "hf"))
  talker = generate.Talker(saved, GREEDY)
  assert talker.format.name == "k2.5"
  image = talker.image(image_path)
  messages = [{"role": "user", "content": "What colour is it?"}]
  prompt = talker.format.prompt(messages, image)
  assert chat_formats.K25Format(tok).prompt(messages, image) == prompt
  assert prompt.count(tok.media.pad) == image.num_tokens == 4        # 56x56: 4x4 patches, merged 2x2
  pixels, layout = media_rows.media_batch([image], saved.cfg, 1)
  features = media_rows.encode_media(saved.params, pixels, layout, cfg=saved.cfg)
  mask = media_lib.placeholder_mask(np.asarray([prompt]), saved.cfg.media_token_ids)
  expected = talker.format.reply(greedy_replies(saved, [prompt], talker.format.stop_ids, (features, mask))[0])
  assert "".join(talker.stream(messages, image)) == expected.text and talker.last == expected
  assert talker.complete([messages], [image]) == [expected]
  first_logprobs = [next(sampler.stream(saved.text_cfg, saved.text_params, np.asarray([prompt]), len(prompt),
                                        jax.random.PRNGKey(0), GREEDY, media=media))[1]
                    for media in ((features, mask), None)]
  assert abs(first_logprobs[0] - first_logprobs[1]) > 1e-6            # the image is seen
  with open(os.path.join(str(tmp_path / "hf"), "tokenizer_config.json")) as f:
    assert "<|im_middle|>" in json.load(f)["chat_template"]


@pytest.mark.slow
def test_the_command_line_prompt_and_prompts_files(legacy_run, tmp_path):
  workdir, folder = legacy_run
  saved = saved_model.load(workdir)
  fmt = chat_formats.for_tokenizer(saved.tokenizer)
  expect = lambda text: fmt.reply(greedy_replies(saved, [fmt.prompt([{"role": "user", "content": text}])],
                                                 fmt.stop_ids)[0])
  run = lambda *args: subprocess.run([sys.executable, "-m", "k25jax.generate", "--max_new_tokens=12", *args],
                                     cwd=CHECKOUT, env=subprocess_env(), capture_output=True, text=True, timeout=300)
  one = run(f"--checkpoint={workdir}", "--prompt=12+30=")
  assert one.returncode == 0, one.stderr[-2000:]
  reply = expect("12+30=")
  assert one.stdout == reply.text + ("\n" if reply.error is None else f"\n[{reply.error}]\n")
  records = [{"prompt": "12+30="}, {"messages": [{"role": "user", "content": "7+8="}], "id": 7}]
  (tmp_path / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
  batch = run(f"--checkpoint={folder}", f"--prompts={tmp_path / 'in.jsonl'}", f"--out={tmp_path / 'out.jsonl'}")
  assert batch.returncode == 0, batch.stderr[-2000:]
  out = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
  assert [o["completion"] for o in out] == [expect("12+30=").text, expect("7+8=").text]
  assert out[1]["id"] == 7 and out[1]["messages"] == records[1]["messages"]
  bad = run(f"--checkpoint={tmp_path / 'nowhere'}", "--prompt=x")
  assert bad.returncode == 2 and "neither a k25jax workdir" in bad.stderr
