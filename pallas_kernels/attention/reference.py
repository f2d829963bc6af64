"""Pure-JAX bidirectional attention with a key-padding mask and GQA: the reference every kernel
is tested against, and the XLA path used on CPU."""
from __future__ import annotations

import jax
import jax.numpy as jnp

_NEG = -1e30  # finite: a row whose keys are all masked yields a uniform (not NaN) softmax


def attention_reference(q_BSNH, k_BLKH, v_BLKH, key_mask_BL=None, *, scale: float | None = None):
    """softmax(q k^T * scale + mask) v, bidirectional.

    q_BSNH: queries (S window positions, N query heads); k_BLKH / v_BLKH: keys/values over the
    full length L with K kv heads (N % K == 0, query head n reads kv head n // (N/K));
    key_mask_BL: bool, True where a key may be attended (False = padding). Scores, softmax and
    the weighted sum accumulate in fp32; the result has q's dtype. Returns out_BSNH.
    """
    B, S, N, H = q_BSNH.shape
    K = k_BLKH.shape[2]
    if N % K:
        raise ValueError(f"attention: {N} query heads is not a multiple of {K} kv heads")
    G = N // K
    scale = H ** -0.5 if scale is None else scale
    q = q_BSNH.reshape(B, S, K, G, H)
    s_BKGSL = jnp.einsum("bskgh,blkh->bkgsl", q, k_BLKH, preferred_element_type=jnp.float32,
                         precision=jax.lax.Precision.HIGHEST) * scale
    if key_mask_BL is not None:
        s_BKGSL = jnp.where(key_mask_BL[:, None, None, None, :], s_BKGSL, _NEG)
    p = jax.nn.softmax(s_BKGSL, axis=-1)
    out = jnp.einsum("bkgsl,blkh->bskgh", p, v_BLKH.astype(jnp.float32),
                     precision=jax.lax.Precision.HIGHEST)
    return out.reshape(B, S, N, H).astype(q_BSNH.dtype)
