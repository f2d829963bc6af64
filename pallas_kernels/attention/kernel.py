"""Flash-style bidirectional attention in Pallas for the dLLM window case.

Queries: the S window tokens (a block, block +/- vicinity, or the whole canvas); keys/values: the
full L-length K/V with the window's fresh K/V already in place; a per-row key-padding mask; GQA.

Grid (B, N, S/block_q): each program holds one query tile of one head, streams the K/V of that
head's kv group (n // (N/K)) in block_kv tiles with an online softmax (fp32 running max, sum and
accumulator), and writes one output tile. The scale is applied in-kernel. Inputs are padded to
tile multiples (padded keys are masked out, padded query rows sliced off), so any S and L work.

The same kernel body lowers with Mosaic on TPU (dimension_semantics all "parallel") and with
Triton on GPU; on CPU it runs with interpret=True, which is how the tests check it.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

_NEG = -1e30  # same finite mask value as the reference: an all-masked row gives a uniform softmax


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Query and key/value tile lengths (multiples of 8)."""
    block_q: int = 128
    block_kv: int = 128

    def validate(self):
        for name in ("block_q", "block_kv"):
            v = getattr(self, name)
            if v <= 0 or v % 8:
                raise ValueError(f"BlockSizes.{name}={v} must be a positive multiple of 8")


SUPPORTED_HEAD_DIMS = (16, 32, 64, 128, 256)


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def _kernel(q_ref, k_ref, v_ref, bias_ref, *refs, scale: float, block_kv: int, num_kv_blocks: int):
    o_ref = refs[-1]  # refs = (o_ref,) or (poisoned_init_ref, o_ref) when the output is pre-poisoned
    q = q_ref[...].astype(jnp.float32) * scale  # (block_q, H)
    bq, H = q.shape

    def body(j, carry):
        m, l, acc = carry
        sl = pl.ds(pl.multiple_of(j * block_kv, block_kv), block_kv)
        k = k_ref[sl, :].astype(jnp.float32)  # (block_kv, H)
        v = v_ref[sl, :].astype(jnp.float32)
        s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        s = s + bias_ref[:, sl]  # (1, block_kv) additive mask
        m_new = jnp.maximum(m, jnp.max(s, axis=1, keepdims=True))
        p = jnp.exp(s - m_new)
        alpha = jnp.exp(m - m_new)
        l_new = alpha * l + jnp.sum(p, axis=1, keepdims=True)
        acc_new = alpha * acc + jnp.dot(p, v, preferred_element_type=jnp.float32)
        return m_new, l_new, acc_new

    init = (jnp.full((bq, 1), _NEG, jnp.float32), jnp.zeros((bq, 1), jnp.float32), jnp.zeros((bq, H), jnp.float32))
    m, l, acc = jax.lax.fori_loop(0, num_kv_blocks, body, init)
    o_ref[...] = (acc / l).astype(o_ref.dtype)


def _compiler_params(backend: str, ndims: int):
    if backend == "tpu":
        from jax.experimental.pallas import tpu as pltpu
        return pltpu.CompilerParams(dimension_semantics=("parallel",) * ndims)
    if backend == "gpu":
        from jax.experimental.pallas import triton as plgpu
        return plgpu.CompilerParams(num_warps=4, num_stages=2)
    return None


def validate(q_BSNH, k_BLKH, v_BLKH, key_mask_BL, block_sizes: BlockSizes):
    """Clear errors for shapes the kernel does not support."""
    if q_BSNH.ndim != 4 or k_BLKH.ndim != 4 or v_BLKH.shape != k_BLKH.shape:
        raise ValueError(f"flash_attention: expected q (B,S,N,H) and k == v shape (B,L,K,H), got "
                         f"q{tuple(q_BSNH.shape)} k{tuple(k_BLKH.shape)} v{tuple(v_BLKH.shape)}")
    B, S, N, H = q_BSNH.shape
    Bk, L, K, Hk = k_BLKH.shape
    if Bk != B or Hk != H:
        raise ValueError(f"flash_attention: q{tuple(q_BSNH.shape)} and k{tuple(k_BLKH.shape)} disagree on batch or head_dim")
    if N % K:
        raise ValueError(f"flash_attention: {N} query heads is not a multiple of {K} kv heads")
    if H not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"flash_attention: head_dim={H} is not supported (supported: {SUPPORTED_HEAD_DIMS})")
    if key_mask_BL is not None and tuple(key_mask_BL.shape) != (B, L):
        raise ValueError(f"flash_attention: key_mask shape {tuple(key_mask_BL.shape)} != (B, L) = {(B, L)}")
    block_sizes.validate()


@functools.partial(jax.jit, static_argnames=("scale", "block_sizes", "backend", "interpret", "poison_output"))
def flash_attention(q_BSNH, k_BLKH, v_BLKH, key_mask_BL=None, *, scale: float | None = None,
                    block_sizes: BlockSizes = BlockSizes(), backend: str = "tpu", interpret: bool = False,
                    poison_output: bool = False):
    """Bidirectional attention (B,S,N,H) x (B,L,K,H) -> (B,S,N,H), fp32 softmax and accumulation.

    key_mask_BL: True where a key may be attended. backend: "tpu" (Mosaic) or "gpu" (Triton);
    interpret=True runs the kernel body in the Pallas interpreter (any platform).
    poison_output (tests): the output buffer starts as NaN (aliased input), so a tile the kernel
    fails to write shows up as NaN.
    """
    validate(q_BSNH, k_BLKH, v_BLKH, key_mask_BL, block_sizes)
    B, S, N, H = q_BSNH.shape
    L, K = k_BLKH.shape[1], k_BLKH.shape[2]
    G = N // K
    bq = min(block_sizes.block_q, _round_up(S, 8))
    bkv = min(block_sizes.block_kv, _round_up(L, 8))
    S_pad, L_pad = _round_up(S, bq), _round_up(L, bkv)
    scale = H ** -0.5 if scale is None else scale
    q = jnp.pad(q_BSNH, ((0, 0), (0, S_pad - S), (0, 0), (0, 0)))
    k = jnp.pad(k_BLKH, ((0, 0), (0, L_pad - L), (0, 0), (0, 0)))
    v = jnp.pad(v_BLKH, ((0, 0), (0, L_pad - L), (0, 0), (0, 0)))
    valid = jnp.ones((B, L), bool) if key_mask_BL is None else key_mask_BL.astype(bool)
    valid = jnp.pad(valid, ((0, 0), (0, L_pad - L)))
    bias = jnp.where(valid, 0.0, _NEG).astype(jnp.float32)[:, None, :]  # (B, 1, L_pad)

    grid = (B, N, S_pad // bq)
    kernel = functools.partial(_kernel, scale=scale, block_kv=bkv, num_kv_blocks=L_pad // bkv)
    q_spec = pl.BlockSpec((None, bq, None, H), lambda b, n, i: (b, i, n, 0))
    kv_spec = pl.BlockSpec((None, L_pad, None, H), lambda b, n, i: (b, 0, n // G, 0))
    in_specs = [q_spec, kv_spec, kv_spec, pl.BlockSpec((None, 1, L_pad), lambda b, n, i: (b, 0, 0))]
    args = [q, k, v, bias]
    aliases = {}
    if poison_output:
        in_specs.append(q_spec)
        args.append(jnp.full((B, S_pad, N, H), jnp.nan, q_BSNH.dtype))
        aliases = {4: 0}
    out = pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=in_specs,
        out_specs=q_spec,
        out_shape=jax.ShapeDtypeStruct((B, S_pad, N, H), q_BSNH.dtype),
        input_output_aliases=aliases,
        compiler_params=None if interpret else _compiler_params(backend, len(grid)),
        interpret=interpret,
        name="dlm_flash_attention",
    )(*args)
    return out[:, :S]
