"""data.vision_source=files: the user's image–text pairs (PNG files written by PIL, the library
that owns the format) become vision samples as the synthetic tasks' are, feed the ViT stage's
and joint pre-training's mixtures, hold out every eval_every-th pair, and every bad pair is one
line naming the file and line."""
import json

import ml_collections
import numpy as np
import pytest
from config_files import load_config
from PIL import Image

from k25jax.data import files, image_text, tokenizer, vision
from k25jax.stages import vit
from k25jax.train import joint

TOK = tokenizer.ByteTokenizer(media=True)


def _pairs(tmp_path, n=8, name="pairs.jsonl"):
  """n solid-colour PNGs of differing sizes under tmp_path/img and a JSON-lines file naming them
  by relative path; caption k says the colour."""
  (tmp_path / "img").mkdir(exist_ok=True)
  records = []
  for k in range(n):
    colour = (37 * k % 256, 255 - 29 * k % 256, 90)
    Image.new("RGB", (40 + 8 * k, 56), colour).save(tmp_path / "img" / f"{k}.png")
    records.append({"image": f"img/{k}.png", "text": f"a block of colour {colour[0]} {colour[1]}"})
  path = tmp_path / name
  path.write_text("".join(json.dumps(r) + "\n" for r in records))
  return str(path), records


def _data(spec, **kw):
  return ml_collections.ConfigDict({"vision_source": "files", "vision_files": spec, "eval_every": 4, **kw})


def test_a_pair_is_bos_the_images_media_tokens_and_its_caption_with_the_loss_on_the_caption(tmp_path):
  path, records = _pairs(tmp_path)
  train, held_out = image_text.load(_data(path))
  assert [p.text for p in held_out] == [records[k]["text"] for k in (0, 4)] and len(train) == 6
  sample = image_text.to_sample(train[0], TOK, max_patches=256)
  expected = vision.preprocess_image(str(tmp_path / "img" / "1.png"), max_patches=256)
  np.testing.assert_array_equal(sample.media[0].pixel_values, expected.pixel_values)
  media_ids = vision.media_token_ids(expected, TOK)
  assert list(sample.tokens[:1 + len(media_ids)]) == [TOK.bos_id, *media_ids]
  assert sample.answer_start == 1 + len(media_ids)
  assert TOK.decode(sample.tokens[sample.answer_start:-1]) == records[1]["text"] and sample.tokens[-1] == TOK.eos_id
  draw = image_text.sampler(train, TOK, seed=0, max_patches=256)
  first_epoch = {TOK.decode(draw(i).tokens[draw(i).answer_start:-1]) for i in range(6)}
  assert first_epoch == {p.text for p in train}                       # each pair once an epoch
  np.testing.assert_array_equal(draw(7).tokens, image_text.sampler(train, TOK, seed=0, max_patches=256)(7).tokens)


def test_the_vit_stage_and_joint_pretraining_draw_the_pairs(tmp_path):
  path, records = _pairs(tmp_path)
  config = load_config("configs/vit.py")
  config.data.update(vision_source="files", vision_files=path, eval_every=4, max_patches=256)
  config.train.update(batch=4, seq_len=128, eval_batches=1)
  vit.check(config)
  train, evals = vit.datasets(config, TOK)
  batch = next(train)
  captions = {r["text"] for r in records}
  taught = TOK.decode(batch["targets"][batch["loss_mask"] > 0])
  drawn = [c for c in captions if c in taught]
  assert len(batch["media"]) >= 4 and len(drawn) == min(len(batch["media"]), 6)   # each image with its caption
  assert all(records[k]["text"] in TOK.decode(evals[0]["targets"][evals[0]["loss_mask"] > 0]) for k in (0, 4))
  config = load_config("configs/pretrain.py", "joint")
  config.data.update(vision_source="files", vision_files=path, eval_every=4, vision_ratio=0.5, max_patches=256)
  config.train.update(batch=4, seq_len=128, eval_batches=1)
  train, _, vision_evals = joint.datasets(config, TOK)
  batch = next(train)
  assert batch["media"] and batch["is_vision"].any() and (batch["is_vision"] == 0).any()
  assert records[0]["text"] in TOK.decode(vision_evals[0]["targets"][vision_evals[0]["loss_mask"] > 0])
  state = train.get_state()
  ahead = next(train)
  again, _, _ = joint.datasets(config, TOK)
  again.set_state(state)
  np.testing.assert_array_equal(next(again)["inputs"], ahead["inputs"])


def test_every_bad_pair_is_one_line_naming_its_file_and_line(tmp_path):
  path, _ = _pairs(tmp_path)
  (tmp_path / "img" / "broken.png").write_bytes(b"not a png")
  lines = {"json.jsonl": '{"image": "img/0.png", "text": "x"}\n{"image": \n',
           "field.jsonl": '{"image": "img/0.png"}\n',
           "missing.jsonl": '{"image": "img/0.png", "text": "x"}\n{"image": "img/none.png", "text": "y"}\n'}
  for name, text in lines.items():
    (tmp_path / name).write_text(text)
  for name, message in [("json.jsonl", "json.jsonl:2: not JSON"), ("field.jsonl", "field.jsonl:1: an image-text pair"),
                        ("missing.jsonl", "missing.jsonl:2: image 'img/none.png' does not exist")]:
    with pytest.raises(files.BadData, match=message):
      image_text.load(_data(str(tmp_path / name)))
  (tmp_path / "broken.jsonl").write_text('{"image": "img/broken.png", "text": "x"}\n')
  [pair] = image_text.read(str(tmp_path / "broken.jsonl"))
  with pytest.raises(files.BadData, match="broken.jsonl:1: image file .* cannot decode"):
    image_text.to_sample(pair, TOK, max_patches=64)
  with pytest.raises(files.BadData, match="pairs.parquet: image-text pairs are JSON lines"):
    (tmp_path / "pairs.parquet").write_bytes(b"")
    image_text.load(_data(str(tmp_path / "pairs.parquet")))
  with pytest.raises(ValueError, match="data.vision_source='web': must be one of"):
    image_text.check(_data(path, vision_source="web"))
