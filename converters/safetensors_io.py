"""Minimal streaming safetensors reader/writer on numpy (bf16 via ml_dtypes): tensors read one at a
time with plain file reads; a truncated file is reported from its header (format:
docs/internals/converters.md).
"""
from __future__ import annotations

import json
import os
import re
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


def parse_size(size: int | str) -> int:
    """Bytes in `size`, read as transformers' convert_file_size_to_int does: an int is bytes; a string
    is an integer with a unit, KiB / MiB / GiB (powers of 2) or KB / MB / GB (powers of 10; a
    trailing lowercase "b" means bits, "5Gb" = 5e9 / 8 bytes); digits alone (a CLI argument) are
    bytes. Raises ValueError naming the value when it is not one of these or not positive."""
    if isinstance(size, str) and size.strip().isdigit():
        n = int(size)
    elif isinstance(size, int) and not isinstance(size, bool):
        n = size
    else:
        m = re.fullmatch(r"(\d+)\s*([KMG])(I?)(B)", str(size).strip(), re.IGNORECASE)
        if m is None:
            raise ValueError(f"size {size!r} is not an integer (bytes) or an integer followed by KB / MB / GB / "
                             f"KiB / MiB / GiB, e.g. '5GB'")
        digits, unit, binary, b = m.groups()
        power = "KMG".index(unit.upper()) + 1
        n = int(digits) * (2 ** (10 * power) if binary else 10 ** (3 * power))
        if not binary and b == "b":
            n //= 8
    if n <= 0:
        raise ValueError(f"size {size!r} must be positive")
    return n


def plan_shards(sizes: "list[tuple[str, int]]", max_size: int) -> list[list[str]]:
    """Names grouped into shards as huggingface_hub's split_state_dict_into_shards does (a tensor larger
    than `max_size` gets a shard of its own)."""
    shards, current, current_size = [], [], 0
    for name, nbytes in sizes:
        if nbytes > max_size:
            shards.append([name])
            continue
        if current_size + nbytes > max_size:
            shards.append(current)
            current, current_size = [], 0
        current.append(name)
        current_size += nbytes
    if current:
        shards.append(current)
    return shards


def shard_file_names(n: int) -> list[str]:
    """`model.safetensors` for one shard, else `model-00001-of-0000N.safetensors` ... (transformers' names)."""
    return ["model.safetensors"] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]


def write_file(path: str, tensors: "dict[str, np.ndarray] | list[tuple[str, callable]]",
               metadata: dict | None = None, specs: dict | None = None, sort: bool = True):
    """Write a .safetensors file.

    `tensors` is either {name: array} or, for streaming, `specs` {name: (dtype, shape)} with
    `tensors` a callable name -> array producing each tensor when it is written. The data is laid
    out in sorted name order, or in `specs`' order with sort=False (the order `tensors` is called).
    """
    if specs is None:
        specs = {k: (v.dtype, v.shape) for k, v in tensors.items()}
        produce = tensors.__getitem__
    else:
        produce = tensors
    order = sorted(specs) if sort else list(specs)
    header, off = {}, 0
    for k in order:
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
        for k in order:
            arr = np.ascontiguousarray(produce(k))
            dt, shape = np.dtype(specs[k][0]), tuple(specs[k][1])
            if arr.dtype != dt or arr.shape != shape:
                raise ConversionError(f"write {k}: got {arr.dtype}{arr.shape}, declared {dt}{shape}")
            f.write(memoryview(arr.reshape(-1).view(np.uint8)))


def write_sharded(folder: str, specs: dict, produce, max_bytes: int) -> list[str]:
    """Write tensors as save_pretrained lays them out: shards of at most `max_bytes` (plan_shards,
    shard_file_names), each tensor made by produce(name) as it is written, in `specs` order ({name:
    (dtype, shape)}), and model.safetensors.index.json when there are several. -> the file names."""
    sizes = {n: int(np.prod(shape, dtype=np.int64)) * np.dtype(dt).itemsize for n, (dt, shape) in specs.items()}
    shards = plan_shards(list(sizes.items()), max_bytes)
    files = shard_file_names(len(shards))
    weight_map = {}
    for fname, names in zip(files, shards):  # one shard file at a time, each tensor streamed into it
        write_file(os.path.join(folder, fname), produce, metadata={"format": "pt"},
                   specs={n: specs[n] for n in names}, sort=False)
        weight_map.update(dict.fromkeys(names, fname))
    if len(files) > 1:
        with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": sum(sizes[n] for n in weight_map)},
                       "weight_map": dict(sorted(weight_map.items()))}, f, indent=1)
    return files
