"""The packed LM pipeline: packing invariants, determinism, exact resume, sharding."""
import numpy as np

from k25jax.data import pipeline, sources, tokenizer

DOCS = [f"document {i}: " + "abc " * (i % 17) for i in range(200)]


def dataset(**kw):
  args = dict(seq_len=16, batch=4, seed=3, max_doc_tokens=120)
  args.update(kw)
  return pipeline.lm_dataset(DOCS, tokenizer.ByteTokenizer(), **args)


def test_packing_invariants():
  for batch in pipeline.take(dataset(), 5):
    for row in range(4):
      seg, pos = batch["segment_ids"][row], batch["positions"][row]
      inputs, targets = batch["inputs"][row], batch["targets"][row]
      np.testing.assert_array_equal(batch["loss_mask"][row], (seg > 0).astype(np.float32))
      ids = seg[seg > 0]
      assert ids[0] == 1 and np.all(np.diff(ids) >= 0) and np.all(np.diff(ids) <= 1)
      assert np.all(seg[len(ids):] == 0)                        # padding only at the end
      for s in np.unique(ids):
        where = np.flatnonzero(seg == s)
        np.testing.assert_array_equal(pos[where], np.arange(len(where)))
        np.testing.assert_array_equal(inputs[where][1:], targets[where][:-1])  # targets = next input
      assert np.all(inputs[seg == 0] == tokenizer.PAD_ID)


def test_documents_are_bos_text_eos():
  tok = tokenizer.ByteTokenizer()
  batch = pipeline.take(dataset(seq_len=64, shuffle=False), 1)[0]
  seg = batch["segment_ids"][0]
  first = seg == 1
  text = tok.decode(batch["inputs"][0][first][1:])
  assert batch["inputs"][0][first][0] == tok.bos_id
  assert batch["targets"][0][first][-1] == tok.eos_id and text in DOCS


def test_deterministic_and_resumable():
  a = pipeline.take(dataset(), 6)
  it = iter(dataset())
  for _ in range(3):
    next(it)
  state = it.get_state()
  resumed = iter(dataset())
  resumed.set_state(state)
  for expected in a[3:]:
    got = next(resumed)
    for name in pipeline.FEATURES:
      np.testing.assert_array_equal(got[name], expected[name])
  other_seed = pipeline.take(dataset(seed=4), 1)[0]
  assert not np.array_equal(other_seed["inputs"], a[0]["inputs"])


def test_process_shards_read_disjoint_documents():
  tok = tokenizer.ByteTokenizer()
  seen = []
  for index in range(2):
    batches = pipeline.take(dataset(seq_len=64, shuffle=False, shard_index=index, shard_count=2), 3)
    texts = set()
    for b in batches:
      for row in range(4):
        for s in np.unique(b["segment_ids"][row][b["segment_ids"][row] > 0]):
          texts.add(tok.decode(b["inputs"][row][b["segment_ids"][row] == s]))
    seen.append(texts)
  assert seen[0] and seen[1] and not seen[0] & seen[1]


def test_stdlib_source_is_offline_and_split():
  docs = sources.load("python_stdlib", 500)
  assert len(docs) > 1000 and max(len(d) for d in docs) <= 500
  train, held_out = sources.split(docs, 50)
  assert len(held_out) == -(-len(docs) // 50) and len(train) + len(held_out) == len(docs)
