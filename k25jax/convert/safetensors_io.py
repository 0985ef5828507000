"""A streaming reader and a writer for the safetensors format, numpy + ml_dtypes only.

File layout: 8-byte little-endian header size N, N bytes of JSON
{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}},
then the raw little-endian tensor bytes. Reading memory-maps the file, so a
tensor costs host memory only when it is materialised (bfloat16 included).
"""
from __future__ import annotations

import json
import math
import os
import struct
from typing import Iterator, Mapping

import ml_dtypes
import numpy as np

from k25jax.convert.common import CheckpointError, at

DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8,
    "BOOL": np.bool_, "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2,
}
NAMES = {np.dtype(v): k for k, v in DTYPES.items()}
# The reference implementation's limit on the JSON header (its `HeaderTooLarge`).
MAX_HEADER_BYTES = 100_000_000


def _no_duplicates(pairs):
  out = {}
  for key, value in pairs:
    if key in out:
      raise ValueError(f"the key {key!r} appears twice")
    out[key] = value
  return out


def _is_count(x) -> bool:
  return isinstance(x, int) and not isinstance(x, bool) and x >= 0


class SafetensorsFile:
  """Lazily reads tensors of one .safetensors file.

  Opening reads and checks only the header (its size against the file's before reading
  it; every entry's dtype, shape and byte range); every malformed file raises a
  CheckpointError naming it (and the tensor).
  """

  def __init__(self, path: str):
    self.path = path
    file_size = os.path.getsize(path)
    with open(path, "rb") as f:
      head = f.read(8)
      if len(head) < 8:
        raise CheckpointError(f"{path} is not a safetensors file: it has {file_size} bytes, "
                              "fewer than the 8 of the header size")
      (size,) = struct.unpack("<Q", head)
      if size > file_size - 8:
        raise CheckpointError(f"{path} is not a safetensors file (or is truncated): its header size "
                              f"field says {size} bytes, the file has {file_size - 8} after it")
      if size > MAX_HEADER_BYTES:
        raise CheckpointError(f"{path}: the safetensors header size field says {size} bytes, more "
                              f"than the format allows ({MAX_HEADER_BYTES})")
      raw = f.read(size)
    try:
      header = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicates)
    except ValueError as e:   # UnicodeDecodeError, JSONDecodeError and a repeated key
      raise CheckpointError(f"{path}: the safetensors header is not valid JSON ({e})") from None
    if not isinstance(header, dict):
      raise CheckpointError(f"{path}: the safetensors header is a JSON {type(header).__name__}, "
                            "not an object of tensors")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict):
      raise CheckpointError(f"{path}: the safetensors '__metadata__' is not an object")
    self.header = header
    self.metadata = metadata
    self._data_start = 8 + size
    for name, info in header.items():
      self._check_entry(name, info, file_size)

  def _check_entry(self, name: str, info, file_size: int) -> None:
    where = at(self.path, name)
    if not isinstance(info, dict) or not {"dtype", "shape", "data_offsets"} <= set(info):
      raise CheckpointError(f"{where}: its header entry needs 'dtype', 'shape' and 'data_offsets', "
                            f"got {info!r:.200}")
    dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
    if not isinstance(dtype, str):
      raise CheckpointError(f"{where}: its dtype {dtype!r:.100} is not a string")
    if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
      raise CheckpointError(f"{where}: its shape {shape!r:.200} is not a list of non-negative integers")
    if (not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_count(o) for o in offsets)
        or offsets[0] > offsets[1]):
      raise CheckpointError(f"{where}: its data_offsets {offsets!r:.200} are not [begin, end] with "
                            "0 <= begin <= end")
    begin, end = offsets
    if dtype in DTYPES:
      expected = math.prod(shape) * np.dtype(DTYPES[dtype]).itemsize
      if end - begin != expected:
        raise CheckpointError(f"{where} has {end - begin} bytes, its shape {shape} and dtype {dtype} "
                              f"need {expected}")
    if self._data_start + end > file_size:
      raise CheckpointError(f"{self.path} is truncated: tensor {name!r} ends at byte "
                            f"{self._data_start + end}, the file has {file_size} bytes")

  def keys(self) -> list[str]:
    return list(self.header)

  def _info(self, name: str) -> dict:
    if name not in self.header:
      raise CheckpointError(f"{at(self.path, name)} is not in this file")
    return self.header[name]

  def shape(self, name: str) -> tuple[int, ...]:
    return tuple(self._info(name)["shape"])

  def dtype(self, name: str) -> str:
    """The stored dtype's safetensors name ("BF16", "I32", ...), read from the header only."""
    return self._info(name)["dtype"]

  def get(self, name: str) -> np.ndarray:
    """The tensor as stored (nothing is cast), read into memory of its own: freed when the
    array is, so a reader of many tensors holds only those it keeps (a memory map's pages
    would stay in the process's resident set)."""
    info = self._info(name)
    if info["dtype"] not in DTYPES:
      raise CheckpointError(f"{at(self.path, name)} has unsupported dtype {info['dtype']} (this reader "
                            f"knows {', '.join(DTYPES)})")
    begin, end = info["data_offsets"]
    if end == begin:
      return np.zeros(info["shape"], DTYPES[info["dtype"]])
    raw = np.empty(end - begin, np.uint8)
    with open(self.path, "rb") as f:
      f.seek(self._data_start + begin)
      if f.readinto(memoryview(raw)) != end - begin:
        raise CheckpointError(f"{at(self.path, name)}: the file ended while reading the tensor")
    return raw.view(DTYPES[info["dtype"]]).reshape(info["shape"])


def write(path: str, tensors: Mapping[str, np.ndarray], metadata: Mapping[str, str] | None = None) -> None:
  """Writes `tensors` (name → array) as one safetensors file."""
  header, offset = {}, 0
  arrays = {}
  for name in sorted(tensors):
    arr = np.ascontiguousarray(tensors[name])
    if arr.dtype not in NAMES:
      raise ValueError(f"{path}: cannot write tensor {name!r} of dtype {arr.dtype}")
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
    with open(index, "rb") as f:
      try:
        weight_map = json.loads(f.read().decode("utf-8"))["weight_map"]
      except (ValueError, TypeError, KeyError) as e:
        raise CheckpointError(f"{index} is not a safetensors index (JSON with a 'weight_map'): "
                              f"{type(e).__name__}: {e}") from None
    if not isinstance(weight_map, dict) or not all(isinstance(s, str) for s in weight_map.values()):
      raise CheckpointError(f"{index}: its 'weight_map' is not an object of tensor name → file name")
    root = os.path.realpath(folder)
    paths = []
    for shard in sorted(set(weight_map.values())):
      path = os.path.join(folder, shard)
      if os.path.commonpath([root, os.path.realpath(path)]) != root:
        raise CheckpointError(f"{index} lists the file {shard!r}, which lies outside {folder}")
      if not os.path.isfile(path):
        raise FileNotFoundError(f"{index} lists the file {shard!r}, which is missing from {folder}")
      paths.append(path)
    return paths
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
