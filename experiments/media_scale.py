"""How loud the image block is: projector-output RMS against text-embedding RMS, per checkpoint.

    python experiments/media_scale.py WORKDIR [WORKDIR ...]     # K2.5 workdirs of configs/sft.py's model

For each workdir's latest params and 8 held-out image tasks (image_tasks, seed 0):

    text  = mean over the byte tokens b of rms(E[b]),   E the token embedding
    media = mean over the merged media tokens m of rms(K25.encode_media(images)[m])
    rms(v) = sqrt(mean_i v_i²)

and their ratio: the scale at which the media rows enter the residual stream, relative to
the text they sit among (experiments/zero_vision.py: the zero-vision transfer fails where
this ratio is large).
"""
from __future__ import annotations

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from k25jax.data import legacy_chat as chat, image_tasks, vision as vision_data  # noqa: E402
from k25jax.model import k25, vision  # noqa: E402
from k25jax.train import config_utils, sharding, trainer as trainer_lib  # noqa: E402


def rms(x: np.ndarray) -> float:
  return float(np.sqrt((np.asarray(x, np.float64) ** 2).mean(-1)).mean())


def main():
  workdirs = sys.argv[1:]
  if not workdirs:
    raise SystemExit(__doc__)
  config = config_utils.load_config_file(os.path.join(ROOT, "configs", "sft.py"), "tiny")
  tok = chat.ChatTokenizer()
  cfg = config_utils.k25_config_from(config.model, tok)
  mesh = sharding.make_mesh(config.mesh.to_dict())
  kinds = image_tasks.parse_kinds(config.data.kinds, "data.kinds")
  tasks = image_tasks.make_tasks(8, 0, config.data.image_size, kinds)
  pixels, grids = vision_data.pack_media([vision_data.preprocess_image(t.image) for t in tasks])
  layout = vision.patch_layout(grids, cfg.vision)
  encode = jax.jit(lambda p: k25.K25(cfg).apply({"params": p}, jnp.asarray(pixels), layout,
                                                method=k25.K25.encode_media))
  print(f"{'workdir':50s} {'text rms':>9s} {'media rms':>10s} {'ratio':>7s}")
  with jax.set_mesh(mesh):
    for workdir in workdirs:
      params = trainer_lib.restore_params(k25.K25(cfg), workdir, mesh)
      text = rms(params[k25.LANGUAGE_MODEL]["embed_tokens"]["embedding"][:256])
      media = rms(encode(params))
      print(f"{workdir:50s} {text:9.3f} {media:10.3f} {media / text:7.1f}")


if __name__ == "__main__":
  main()
