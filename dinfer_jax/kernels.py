"""The one place where the compile target picks kernels and platform-dependent paths: attention
(xla / reference / pallas / cudnn), expert matmuls (dense / ragged / tiled / pallas), whether a
Pallas kernel is interpreted, the CPU-only in-place layer reads, and the TPU K/V layout pin.
`platform` is the compile target ("cpu" | "tpu" | "gpu" | "cuda" | "rocm"; None =
jax.default_backend()). Model files call this module, never a kernel package's internals.
Why each default: docs/internals/kernels.md."""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from pallas_kernels.attention import BlockSizes, allowed_mask, attention_reference, flash_attention
from pallas_kernels.moe import swiglu_experts_gmm, swiglu_experts_tiled

PLATFORMS = ("cpu", "tpu", "gpu", "cuda", "rocm")
GPU_PLATFORMS = ("gpu", "cuda", "rocm")
ATTENTION_IMPLS = ("auto", "xla", "pallas", "reference", "cudnn")
EXPERT_IMPLS = ("auto", "ragged", "tiled", "pallas", "dense")

__all__ = ["ATTENTION_IMPLS", "EXPERT_IMPLS", "PLATFORMS", "KernelConfig", "attention", "attention_impl",
           "expert_impl",
           "experts_gmm", "experts_tiled", "pins_kv_layout", "reads_layers_in_place", "target_platform"]


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """The static choices a model compiles with, one object from the Transformer down to Attention
    and MoE: the attention path (ATTENTION_IMPLS), the expert path (EXPERT_IMPLS), the compile
    target (None: jax.default_backend()) and the device mesh (None: one device)."""
    attention: str = "auto"
    experts: str = "auto"
    platform: str | None = None
    mesh: Any = None

    def __post_init__(self):
        if self.attention not in ATTENTION_IMPLS:
            raise ValueError(f"attention impl {self.attention!r} is not one of {ATTENTION_IMPLS}")
        if self.experts not in EXPERT_IMPLS:
            raise ValueError(f"expert impl {self.experts!r} is not one of {EXPERT_IMPLS}")
        if self.platform is not None:
            target_platform(self.platform)


def target_platform(platform: str | None) -> str:
    """The platform kernels are chosen for: `platform`, or jax.default_backend() when None."""
    platform = jax.default_backend() if platform is None else platform
    if platform not in PLATFORMS:
        raise ValueError(f"unknown platform {platform!r}; choose one of {PLATFORMS}")
    return platform


def attention_impl(impl: str, platform: str | None = None) -> str:
    """The concrete attention path: "auto" is "xla" on CPU, "pallas" on TPU and GPU."""
    if impl not in ATTENTION_IMPLS:
        raise ValueError(f"attention impl {impl!r} is not one of {ATTENTION_IMPLS}")
    if impl == "auto":
        return "xla" if target_platform(platform) == "cpu" else "pallas"
    return impl


def expert_impl(impl: str, platform: str | None = None) -> str:
    """The concrete expert path: "auto" is "pallas" on TPU, "tiled" on CPU, "ragged" on GPU."""
    if impl not in EXPERT_IMPLS:
        raise ValueError(f"unknown moe impl {impl!r}; choose one of {EXPERT_IMPLS}")
    if impl == "auto":
        return {"tpu": "pallas", "cpu": "tiled"}.get(target_platform(platform), "ragged")
    return impl


def reads_layers_in_place(platform: str | None, mesh) -> bool:
    """Whether layer weights are read from the layer stack in column tiles (models/stacked.py): one
    CPU device only, where XLA:CPU would otherwise copy every slice of a stack."""
    return target_platform(platform) == "cpu" and (mesh is None or mesh.size == 1)


def pins_kv_layout(platform: str | None) -> bool:
    """Whether fresh K/V are pinned row-major (cache.row_major): an XLA:TPU target only."""
    return target_platform(platform) == "tpu"


def experts_gmm(x_sorted, group_sizes, w_gate_EDF, w_up_EDF, w_down_EFD, platform: str | None = None):
    """SwiGLU experts over expert-sorted rows with the Pallas grouped matmul (interpreted unless
    the target is TPU). x_sorted (T, D), group_sizes (E,) -> (T, D)."""
    return swiglu_experts_gmm(x_sorted, group_sizes, w_gate_EDF, w_up_EDF, w_down_EFD,
                              interpret=target_platform(platform) != "tpu")


experts_tiled = swiglu_experts_tiled


def _cudnn(q_BSNH, k_BLKH, v_BLKH, allowed):
    B, S, N, H = q_BSNH.shape
    L = k_BLKH.shape[1]
    mask = None
    if allowed is not None:
        allowed = jnp.broadcast_to(allowed, (B, 1, S, L))
        # Rows with no valid key: dot_product_attention would give NaN; the reference gives a
        # uniform softmax. Such rows only occur for padded queries; keep them finite.
        allowed = allowed | ~jnp.any(allowed, axis=-1, keepdims=True)
        mask = jnp.broadcast_to(allowed, (B, N, S, L))
    out = jax.nn.dot_product_attention(q_BSNH, k_BLKH.astype(q_BSNH.dtype), v_BLKH.astype(q_BSNH.dtype),
                                       mask=mask, implementation="cudnn")
    return out.astype(q_BSNH.dtype)


def attention(q_BSNH, k_BLKH, v_BLKH, key_mask_BL=None, *, q_pos_BS=None, k_pos_BL=None, block_size: int = 0,
              impl: str = "auto", block_sizes: BlockSizes | None = None, interpret: bool | None = None,
              platform: str | None = None, mesh=None, batch_axes: tuple = (), head_axes: tuple = ()):
    """(B,S,N,H) queries over (B,L,K,H) keys/values -> (B,S,N,H). key_mask_BL: True = attend;
    block_size > 0: block-causal over q_pos_BS (B,S) / k_pos_BL (B,L) (reference.allowed_mask).
    interpret: None = only when the target is CPU. mesh: the Pallas kernel runs per shard in a
    shard_map, rows over `batch_axes`, heads over `head_axes` (K must divide)."""
    platform = target_platform(platform)
    impl = attention_impl(impl, platform)
    mask_kw = dict(q_pos_BS=q_pos_BS, k_pos_BL=k_pos_BL, block_size=block_size)
    if impl in ("xla", "reference"):
        return attention_reference(q_BSNH, k_BLKH, v_BLKH, key_mask_BL, **mask_kw)
    if impl == "cudnn":
        return _cudnn(q_BSNH, k_BLKH, v_BLKH, allowed_mask(q_BSNH.shape, key_mask_BL, **mask_kw))
    if block_size and (q_pos_BS is None or k_pos_BL is None):
        raise ValueError("block-causal attention needs q_pos_BS and k_pos_BL")
    backend = "gpu" if platform in GPU_PLATFORMS else "tpu"
    if interpret is None:
        interpret = platform == "cpu"
    B, S, L = q_BSNH.shape[0], q_BSNH.shape[1], k_BLKH.shape[1]
    mask = jnp.ones((B, L), bool) if key_mask_BL is None else key_mask_BL
    q_pos = jnp.zeros((B, S), jnp.int32) if q_pos_BS is None else q_pos_BS
    k_pos = jnp.zeros((B, L), jnp.int32) if k_pos_BL is None else k_pos_BL

    def run(q, k, v, m, qp, kp):
        return flash_attention(q, k, v, m, q_pos_BS=qp, k_pos_BL=kp, block_size=block_size,
                               block_sizes=block_sizes or BlockSizes(), backend=backend, interpret=interpret)
    if mesh is not None and mesh.size > 1:
        rows, heads = (tuple(batch_axes) or None), (tuple(head_axes) or None)
        qkv, per_row = P(rows, None, heads, None), P(rows, None)
        run = jax.shard_map(run, mesh=mesh, in_specs=(qkv, qkv, qkv, per_row, per_row, per_row), out_specs=qkv,
                            check_vma=False)
    return run(q_BSNH, k_BLKH, v_BLKH, mask, q_pos, k_pos)
