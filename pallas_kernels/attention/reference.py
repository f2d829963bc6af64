"""Pure-JAX masked-token attention with GQA, a key-padding mask and an optional block-causal mask:
the reference every kernel is tested against, and the XLA path used on CPU."""
from __future__ import annotations

import jax
import jax.numpy as jnp

_NEG = -1e30  # finite: a row whose keys are all masked yields a uniform (not NaN) softmax


def allowed_mask(q_BSNH_shape, key_mask_BL=None, q_pos_BS=None, k_pos_BL=None, block_size: int = 0):
    """bool (B, 1, S, L) or (B, 1, 1, L) or None: True where query s may attend key l. block_size 0:
    the key mask only; > 0: also k_pos_BL[l] // block_size <= q_pos_BS[s] // block_size (per-row
    token positions)."""
    B, S = q_BSNH_shape[0], q_BSNH_shape[1]
    out = None if key_mask_BL is None else key_mask_BL[:, None, None, :]
    if block_size:
        if q_pos_BS is None or k_pos_BL is None:
            raise ValueError("block-causal attention needs q_pos_BS and k_pos_BL")
        qb = (q_pos_BS // block_size)[:, None, :, None]
        kb = (k_pos_BL // block_size)[:, None, None, :]
        causal = kb <= qb
        out = causal if out is None else out & causal
    return out


def attention_reference(q_BSNH, k_BLKH, v_BLKH, key_mask_BL=None, *, q_pos_BS=None, k_pos_BL=None,
                        block_size: int = 0, scale: float | None = None):
    """softmax(q k^T * scale + mask) v: q_BSNH over k_BLKH / v_BLKH (query head n reads kv head
    n // (N/K)) -> out_BSNH in q's dtype, fp32 inside. key_mask_BL: True = attend; block_size > 0
    adds the block-causal mask (`allowed_mask`)."""
    B, S, N, H = q_BSNH.shape
    K = k_BLKH.shape[2]
    if N % K:
        raise ValueError(f"attention: {N} query heads is not a multiple of {K} kv heads")
    G = N // K
    scale = H ** -0.5 if scale is None else scale
    q = q_BSNH.reshape(B, S, K, G, H)
    s_BKGSL = jnp.einsum("bskgh,blkh->bkgsl", q, k_BLKH, preferred_element_type=jnp.float32,
                         precision=jax.lax.Precision.HIGHEST) * scale
    allowed = allowed_mask(q_BSNH.shape, key_mask_BL, q_pos_BS, k_pos_BL, block_size)
    if allowed is not None:
        s_BKGSL = jnp.where(allowed[:, :, None], s_BKGSL, _NEG)
    p = jax.nn.softmax(s_BKGSL, axis=-1)
    out = jnp.einsum("bkgsl,blkh->bskgh", p, v_BLKH.astype(jnp.float32),
                     precision=jax.lax.Precision.HIGHEST)
    return out.reshape(B, S, N, H).astype(q_BSNH.dtype)
