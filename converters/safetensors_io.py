"""Minimal streaming safetensors reader/writer on numpy (bf16 via ml_dtypes).

The format: 8-byte little-endian header length n, n bytes of JSON
{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}, then the data.
Tensors are read one at a time with plain file reads (no mmap), so host memory holds only the
tensor being copied, and a truncated file is reported from its header before any data is read.
"""
from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass

import ml_dtypes
import numpy as np

from converters.errors import ConversionError

DTYPES = {
    "F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16), "I64": np.dtype(np.int64), "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16), "I8": np.dtype(np.int8), "U8": np.dtype(np.uint8), "BOOL": np.dtype(np.bool_),
}
_NAMES = {v: k for k, v in DTYPES.items()}


@dataclass(frozen=True)
class TensorInfo:
    file: str
    dtype: np.dtype
    shape: tuple[int, ...]
    offset: int  # absolute byte offset of the data in the file
    nbytes: int


def read_header(path: str) -> dict[str, TensorInfo]:
    """Parse and validate one .safetensors header. Raises ConversionError naming the file."""
    size = os.path.getsize(path)
    name = os.path.basename(path)
    if size < 8:
        raise ConversionError(f"{name}: file is truncated ({size} bytes; not even a header length)")
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        if n > size - 8:
            raise ConversionError(f"{name}: file is truncated (header declares {n} bytes, file has {size})")
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ConversionError(f"{name}: corrupt safetensors header ({e})") from None
    base = 8 + n
    out, end_max = {}, 0
    for key, meta in header.items():
        if key == "__metadata__":
            continue
        if meta.get("dtype") not in DTYPES:
            raise ConversionError(f"{name}: tensor {key!r} has unsupported dtype {meta.get('dtype')!r}")
        dt = DTYPES[meta["dtype"]]
        shape = tuple(int(s) for s in meta["shape"])
        b, e = (int(v) for v in meta["data_offsets"])
        if e - b != int(np.prod(shape, dtype=np.int64)) * dt.itemsize:
            raise ConversionError(f"{name}: tensor {key!r} byte range {b}..{e} does not match "
                                  f"shape {shape} {meta['dtype']}")
        end_max = max(end_max, e)
        out[key] = TensorInfo(path, dt, shape, base + b, e - b)
    if base + end_max > size:
        raise ConversionError(f"{name}: file is truncated: its header declares {base + end_max} bytes, "
                              f"the file has {size}")
    return out


def read_tensor(info: TensorInfo, out: np.ndarray | None = None) -> np.ndarray:
    """Read one tensor (into `out` when given: a C-contiguous array of the same shape and dtype)."""
    if out is None:
        out = np.empty(info.shape, info.dtype)
    buf = memoryview(out.reshape(-1).view(np.uint8))
    with open(info.file, "rb") as f:
        f.seek(info.offset)
        got = f.readinto(buf)
    if got != info.nbytes:
        raise ConversionError(f"{os.path.basename(info.file)}: short read ({got} of {info.nbytes} bytes)")
    return out


def write_file(path: str, tensors: "dict[str, np.ndarray] | list[tuple[str, callable]]",
               metadata: dict | None = None, specs: dict | None = None):
    """Write a .safetensors file.

    `tensors` is either {name: array} or, for streaming, `specs` {name: (dtype, shape)} with
    `tensors` a callable name -> array producing each tensor when it is written.
    """
    if specs is None:
        specs = {k: (v.dtype, v.shape) for k, v in tensors.items()}
        produce = tensors.__getitem__
    else:
        produce = tensors
    header, off = {}, 0
    for k in sorted(specs):
        dt, shape = np.dtype(specs[k][0]), tuple(specs[k][1])
        nb = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
        header[k] = {"dtype": _NAMES[dt], "shape": list(shape), "data_offsets": [off, off + nb]}
        off += nb
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for k in sorted(specs):
            arr = np.ascontiguousarray(produce(k))
            dt, shape = np.dtype(specs[k][0]), tuple(specs[k][1])
            if arr.dtype != dt or arr.shape != shape:
                raise ConversionError(f"write {k}: got {arr.dtype}{arr.shape}, declared {dt}{shape}")
            f.write(memoryview(arr.reshape(-1).view(np.uint8)))
