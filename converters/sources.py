"""Read a Hugging Face checkpoint folder tensor by tensor: `open_source(folder)` -> TensorSource over
*.safetensors (indexed or not) or `pytorch_model*.bin`; `specs` {name: (shape, dtype)} from headers,
`read(name)`, `read_slab(name, i)` = tensor[i] reading only it.
"""
from __future__ import annotations

import glob
import json
import os
from dataclasses import replace

import ml_dtypes
import numpy as np

from converters.errors import ConversionError
from converters.safetensors_io import TensorInfo, read_header, read_tensor


class TensorSource:
    specs: dict[str, tuple[tuple[int, ...], np.dtype]]

    def read(self, name: str) -> np.ndarray:
        raise NotImplementedError

    def read_slab(self, name: str, index: int) -> np.ndarray:
        return self.read(name)[index]

    def close(self):
        pass


class SafetensorsSource(TensorSource):
    def __init__(self, files: list[str]):
        self.infos: dict[str, TensorInfo] = {}
        for path in files:
            for k, info in read_header(path).items():
                if k in self.infos:
                    raise ConversionError(f"tensor {k!r} appears in both {os.path.basename(self.infos[k].file)} "
                                          f"and {os.path.basename(path)}")
                self.infos[k] = info
        self.specs = {k: (i.shape, i.dtype) for k, i in self.infos.items()}

    def read(self, name):
        return read_tensor(self.infos[name])

    def read_slab(self, name, index):
        info = self.infos[name]
        sub = info.nbytes // info.shape[0]
        return read_tensor(replace(info, shape=info.shape[1:], offset=info.offset + index * sub, nbytes=sub))


def _torch_to_numpy(t):
    import torch
    t = t.detach().contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16).copy()
    return t.numpy().copy()


class TorchBinSource(TensorSource):
    def __init__(self, files: list[str]):
        try:
            import torch
        except ImportError:
            raise ConversionError("reading PyTorch .bin checkpoints needs torch (pip install torch)") from None
        self.tensors = {}
        for path in files:
            try:
                sd = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            except Exception as e:  # torch raises many types for corrupt zip/pickle files
                raise ConversionError(f"{os.path.basename(path)}: cannot load as a PyTorch checkpoint "
                                      f"(weights_only=True): {e}") from None
            for k, v in sd.items():
                if not isinstance(v, torch.Tensor):
                    raise ConversionError(f"{os.path.basename(path)}: entry {k!r} is not a tensor")
                self.tensors[k] = v
        dt = {torch.float32: np.float32, torch.float16: np.float16, torch.bfloat16: ml_dtypes.bfloat16,
              torch.float64: np.float64, torch.int64: np.int64, torch.int32: np.int32}
        self.specs = {k: (tuple(v.shape), np.dtype(dt.get(v.dtype, np.float32))) for k, v in self.tensors.items()}

    def read(self, name):
        return _torch_to_numpy(self.tensors[name])

    def read_slab(self, name, index):
        return _torch_to_numpy(self.tensors[name][index])

    def close(self):
        self.tensors.clear()


def _index_files(folder: str, index_name: str) -> list[str]:
    with open(os.path.join(folder, index_name)) as f:
        try:
            wm = json.load(f)["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise ConversionError(f"{index_name}: not a valid index file ({e})") from None
    files = sorted(set(wm.values()))
    missing = [x for x in files if not os.path.isfile(os.path.join(folder, x))]
    if missing:
        raise ConversionError(f"{index_name} names shard files that are missing: {', '.join(missing)}")
    return [os.path.join(folder, x) for x in files]


def open_source(folder: str) -> TensorSource:
    if not os.path.isdir(folder):
        raise ConversionError(f"{folder}: not a directory")
    if os.path.isfile(os.path.join(folder, "model.safetensors.index.json")):
        return SafetensorsSource(_index_files(folder, "model.safetensors.index.json"))
    st = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
    if st:
        return SafetensorsSource(st)
    if os.path.isfile(os.path.join(folder, "pytorch_model.bin.index.json")):
        return TorchBinSource(_index_files(folder, "pytorch_model.bin.index.json"))
    bins = sorted(glob.glob(os.path.join(folder, "*.bin")))
    if bins:
        return TorchBinSource(bins)
    raise ConversionError(f"{folder}: no *.safetensors or *.bin weight files found")
