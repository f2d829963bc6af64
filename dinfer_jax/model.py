"""`load_model(path) -> Model`: a dinfer-jax checkpoint or a plain Hugging Face folder."""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dinfer_jax import checkpoint as ckpt
from dinfer_jax import sharding as shd
from dinfer_jax.config import ModelConfig
from dinfer_jax.kernels import KernelConfig
from dinfer_jax.models import Transformer, flatten, unflatten
from dinfer_jax.models import placement
from dinfer_jax.token_ids import check_token_ids


def default_dtype():
    """fp32 on CPU, bf16 on accelerators (docs/facts/conventions.md numerics)."""
    return jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16


@dataclass
class Model:
    """A config plus an explicit params pytree. `logits(ids)` runs the full bidirectional forward.
    With `mesh`, params are global arrays (`with_mesh` / `load_model(..., mesh=)`), the MoE runs expert
    parallel, and inputs / outputs are placed / gathered for every process."""
    config: ModelConfig
    params: dict
    moe_impl: str = "auto"
    attention_impl: str = "auto"
    mesh: Any = None
    platform: str | None = None  # compile target for kernel choice; None = where the params live
    folder: str | None = None  # the model folder it was loaded from (its decoding defaults: SamplingParams.for_model)

    def with_mesh(self, mesh) -> "Model":
        """The same model with params placed on `mesh` (ShardingError if the mesh does not fit)."""
        if mesh is None:
            return Model(self.config, self.params, self.moe_impl, self.attention_impl, None, self.platform, self.folder)
        placement.check_mesh_fits(self.config, mesh)
        flat = placement.shard_params(flatten(self.params), self.config, mesh)
        return Model(self.config, unflatten(flat), self.moe_impl, self.attention_impl, mesh, self.platform, self.folder)

    @property
    def target_platform(self) -> str:
        """The platform kernels are chosen for: `platform`, else that of the params' devices (the
        mesh's for abstract params), else jax.default_backend()."""
        if self.platform is not None:
            return self.platform
        leaf = jax.tree_util.tree_leaves(self.params)[0]
        sharding = getattr(leaf, "sharding", None)
        if sharding is not None:
            return next(iter(sharding.device_set)).platform
        if self.mesh is not None:
            return self.mesh.devices.flat[0].platform
        return jax.default_backend()

    @property
    def dtype(self):
        """The activations' dtype: the embedding table's (never quantized)."""
        return self.params["embed"]["embedding"].dtype

    @functools.cached_property
    def module(self) -> Transformer:
        return Transformer(self.config, self.dtype, KernelConfig(self.attention_impl, self.moe_impl,
                                                                 self.target_platform, self.mesh))

    @functools.cached_property
    def _forward(self):
        out = None if self.mesh is None else shd.NamedSharding(self.mesh, shd.P())
        return jax.jit(lambda p, t, m: self.module.apply({"params": p}, t, key_mask_BL=m)[0], out_shardings=out)

    def batch_sharding(self, shape: tuple):
        """The NamedSharding of a (B, ...) input (rows over the mesh's batch axes); None without a mesh."""
        if self.mesh is None:
            return None
        axes = shd.batch_axes(shape[0], self.mesh)
        return shd.NamedSharding(self.mesh, shd.P(axes if axes else None, *([None] * (len(shape) - 1))))

    def replicated(self):
        """The NamedSharding of a replicated input; None without a mesh."""
        return None if self.mesh is None else shd.NamedSharding(self.mesh, shd.P())

    def place(self, arr, like: jax.ShapeDtypeStruct):
        """A host array -> a device array placed as the ShapeDtypeStruct `like` says (see
        Generator.program_args); the default device when `like` has no sharding."""
        arr = np.asarray(arr, like.dtype)
        return jnp.asarray(arr) if like.sharding is None else shd.to_global(arr, like.sharding)

    def place_batch(self, arr: np.ndarray):
        """A host (B, ...) array -> device array, split over the mesh's batch axes when there is a mesh."""
        arr = np.asarray(arr)
        return self.place(arr, jax.ShapeDtypeStruct(arr.shape, arr.dtype, sharding=self.batch_sharding(arr.shape)))

    def abstract_params(self):
        """The params as ShapeDtypeStructs (their shardings kept when there is a mesh)."""
        def sds(x):
            sharding = getattr(x, "sharding", None) if self.mesh is not None else None
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
        return jax.tree_util.tree_map(sds, self.params)

    @property
    def data_parallel(self) -> int:
        """Size of the mesh's data axis (batches are padded to a multiple of it); 1 without a mesh."""
        return 1 if self.mesh is None else self.mesh.shape["data"]

    def batch_shards(self, batch: int) -> int:
        """How many ways a batch of `batch` rows is split over the mesh (the data axis, and the expert
        axis too when the batch divides: sharding.batch_axes); 1 without a mesh."""
        return math.prod(self.mesh.shape[a] for a in shd.batch_axes(batch, self.mesh)) if self.mesh is not None else 1

    @functools.cached_property
    def generator(self):
        """The compiled-program cache used by `dinfer_jax.generate`."""
        from dinfer_jax.engine import Generator
        return Generator(self)

    def check_ids(self, ids) -> np.ndarray:
        """ids (L,) or (B, L) -> int32, or a ValueError naming the bad id / shape / length."""
        return check_token_ids(ids, self.config.vocab_size, self.config.max_position_embeddings)

    def logits(self, ids, key_mask=None) -> np.ndarray:
        """ids (L,) or (B, L) ints -> fp32 logits (L, V) or (B, L, V). key_mask: True = attend."""
        arr = self.check_ids(ids)
        squeeze = arr.ndim == 1
        arr2 = arr[None] if squeeze else arr
        if arr2.shape[0] % self.data_parallel:
            raise shd.ShardingError(f"batch of {arr2.shape[0]} rows does not split over the mesh's data axis "
                                    f"of size {self.data_parallel}; pad the batch to a multiple of it")
        mask = None if key_mask is None else self.place_batch(np.asarray(key_mask, bool).reshape(arr2.shape))
        out = shd.to_host(self._forward(self.params, self.place_batch(arr2), mask))
        return out[0] if squeeze else out


def load_model(path: str, dtype=None, moe_impl: str = "auto", attention_impl: str = "auto",
               progress: bool = False, mesh=None) -> Model:
    """Load a dinfer-jax checkpoint or a plain HF folder (converted in memory). dtype: params dtype
    (default fp32 on CPU, bf16 elsewhere). mesh: restore the params straight into its shardings."""
    path = ckpt.check_model_folder(path)
    dtype = default_dtype() if dtype is None else dtype
    if mesh is not None and ckpt.is_checkpoint(path):
        cfg = ckpt.read_config(path)
        placement.check_mesh_fits(cfg, mesh)
        man = ckpt.read_manifest(path)
        shardings = placement.param_shardings(cfg, mesh, {k: v["shape"] for k, v in man["params"].items()},
                                        man.get("quantization"))
        flat = ckpt.read_params(path, dtype=dtype, shardings=shardings)
        return Model(cfg, unflatten(flat), moe_impl, attention_impl, mesh, folder=path)
    if ckpt.is_checkpoint(path):  # one parameter at a time on host: peak = params + the largest one
        cfg = ckpt.read_config(path)
        man = ckpt.read_manifest(path)
        from dinfer_jax.models.quant import pack_flat
        flat = pack_flat({p: jnp.asarray(ckpt.read_param(path, p, None, None, man),
                                         dtype=None if ckpt.is_quantized_leaf(man, p) else dtype)
                          for p in man["params"]}, man.get("quantization"))
    else:
        from converters.hf_import import load_hf_params
        cfg, host = load_hf_params(path, progress=progress)
        flat = {k: jnp.asarray(host.pop(k), dtype=dtype) for k in list(host)}
    model = Model(cfg, unflatten(flat), moe_impl, attention_impl, folder=path)
    return model if mesh is None else model.with_mesh(mesh)
