"""A streaming reader and a writer for the safetensors format, numpy + ml_dtypes only.

File layout: 8-byte little-endian header size N, N bytes of JSON
{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}},
then the raw little-endian tensor bytes. Reading memory-maps the file, so a
tensor costs host memory only when it is materialised (bfloat16 included).
"""
from __future__ import annotations

import json
import os
import struct
from typing import Iterator, Mapping

import ml_dtypes
import numpy as np

DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8,
    "BOOL": np.bool_, "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2,
}
NAMES = {np.dtype(v): k for k, v in DTYPES.items()}


class SafetensorsFile:
  """Lazily reads tensors of one .safetensors file."""

  def __init__(self, path: str):
    self.path = path
    with open(path, "rb") as f:
      (size,) = struct.unpack("<Q", f.read(8))
      self.header = json.loads(f.read(size))
    self.metadata = self.header.pop("__metadata__", {}) or {}
    self._data_start = 8 + size
    self._map = np.memmap(path, dtype=np.uint8, mode="r") if os.path.getsize(path) > self._data_start else None

  def keys(self) -> list[str]:
    return list(self.header)

  def shape(self, name: str) -> tuple[int, ...]:
    return tuple(self.header[name]["shape"])

  def get(self, name: str) -> np.ndarray:
    info = self.header[name]
    if info["dtype"] not in DTYPES:
      raise ValueError(f"{self.path}: tensor {name!r} has unsupported dtype {info['dtype']}")
    begin, end = info["data_offsets"]
    dtype = np.dtype(DTYPES[info["dtype"]])
    expected = int(np.prod(info["shape"], dtype=np.int64)) * dtype.itemsize
    if end - begin != expected:
      raise ValueError(f"{self.path}: tensor {name!r} has {end - begin} bytes, its shape "
                       f"{info['shape']} and dtype {info['dtype']} need {expected}")
    size = 0 if self._map is None else len(self._map)
    if self._data_start + end > size:
      raise ValueError(f"{self.path} is truncated: tensor {name!r} ends at byte {self._data_start + end}, "
                       f"the file has {size} bytes")
    raw = self._map[self._data_start + begin:self._data_start + end]
    return np.frombuffer(raw, dtype=dtype).reshape(info["shape"])


def write(path: str, tensors: Mapping[str, np.ndarray], metadata: Mapping[str, str] | None = None) -> None:
  """Writes `tensors` (name → array) as one safetensors file."""
  header, offset = {}, 0
  arrays = {}
  for name in sorted(tensors):
    arr = np.ascontiguousarray(tensors[name])
    if arr.dtype not in NAMES:
      raise ValueError(f"cannot write tensor {name!r} of dtype {arr.dtype}")
    header[name] = {"dtype": NAMES[arr.dtype], "shape": list(arr.shape),
                    "data_offsets": [offset, offset + arr.nbytes]}
    arrays[name] = arr
    offset += arr.nbytes
  if metadata:
    header["__metadata__"] = dict(metadata)
  blob = json.dumps(header, separators=(",", ":")).encode()
  blob += b" " * (-len(blob) % 8)
  with open(path, "wb") as f:
    f.write(struct.pack("<Q", len(blob)))
    f.write(blob)
    for name in sorted(arrays):
      f.write(arrays[name].tobytes())


def checkpoint_files(folder: str) -> list[str]:
  """The safetensors files of a Hugging Face folder (sharded index or single file)."""
  index = os.path.join(folder, "model.safetensors.index.json")
  if os.path.exists(index):
    with open(index) as f:
      shards = sorted(set(json.load(f)["weight_map"].values()))
    return [os.path.join(folder, s) for s in shards]
  files = sorted(n for n in os.listdir(folder) if n.endswith(".safetensors"))
  if not files:
    raise FileNotFoundError(f"no .safetensors files in {folder}")
  return [os.path.join(folder, n) for n in files]


def iterate(folder: str) -> Iterator[tuple[str, SafetensorsFile]]:
  """(tensor name, the file holding it) over every shard of a checkpoint folder."""
  for path in checkpoint_files(folder):
    f = SafetensorsFile(path)
    for name in f.keys():
      yield name, f
