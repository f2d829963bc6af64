"""Layer math against float64 numpy references written from the papers' formulas."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dinfer_jax.models.layers import rms_normalize, rotary_embedding
from pallas_kernels.attention import attention_reference

pytestmark = pytest.mark.smoke


def rope_np(x, pos, theta, rot):
    """Rotate-half RoPE in float64 on the first `rot` dims."""
    x = x.astype(np.float64)
    half = rot // 2
    inv = theta ** (-np.arange(0, rot, 2) / rot)
    ang = pos[..., None].astype(np.float64) * inv
    cos, sin = np.cos(ang)[:, :, None], np.sin(ang)[:, :, None]
    x1, x2 = x[..., :half], x[..., half:rot]
    out = x.copy()
    out[..., :half] = x1 * cos - x2 * sin
    out[..., half:rot] = x2 * cos + x1 * sin
    return out


@pytest.mark.parametrize("rot", [16, 8])
def test_rotary_full_and_partial(rng, rot):
    x = rng.randn(2, 7, 3, 16).astype(np.float32)
    pos = rng.randint(0, 4000, (2, 7))
    got = np.asarray(rotary_embedding(jnp.asarray(x), jnp.asarray(pos), 50000.0, rot))
    want = rope_np(x, pos, 50000.0, rot)
    # fp32 angles (as in HF / LLaDA): pos * inv_freq <= 4000 rad is rounded to half an ulp,
    # 2**-13 rad, so |error| <= 2**-13 * (|x1| + |x2|) plus a few ulps of the products.
    np.testing.assert_allclose(got, want, rtol=0, atol=2.0 ** -13 * 2 * np.abs(x).max() + 1e-5)
    if rot < 16:
        np.testing.assert_array_equal(got[..., rot:], x[..., rot:])  # pass-through dims untouched


def test_rms_norm(rng):
    x = rng.randn(3, 5, 32).astype(np.float32) * 3
    w = rng.randn(32).astype(np.float32)
    want = x / np.sqrt((x.astype(np.float64) ** 2).mean(-1, keepdims=True) + 1e-5) * w
    np.testing.assert_allclose(np.asarray(rms_normalize(jnp.asarray(x), jnp.asarray(w), 1e-5)), want, rtol=1e-5, atol=1e-6)


def attention_np(q, k, v, mask):
    B, S, N, H = q.shape
    G = N // k.shape[2]
    out = np.zeros((B, S, N, H))
    for b in range(B):
        for n in range(N):
            s = q[b, :, n].astype(np.float64) @ k[b, :, n // G].T.astype(np.float64) / np.sqrt(H)
            s = np.where(mask[b][None, :], s, -np.inf)
            p = np.exp(s - s.max(-1, keepdims=True))
            p /= p.sum(-1, keepdims=True)
            out[b, :, n] = p @ v[b, :, n // G]
    return out


@pytest.mark.parametrize("N,K", [(4, 4), (4, 2), (4, 1)])
def test_attention_gqa_and_key_padding(rng, N, K):
    B, S, L, H = 2, 5, 9, 16
    q, k, v = rng.randn(B, S, N, H), rng.randn(B, L, K, H), rng.randn(B, L, K, H)
    mask = np.ones((B, L), bool)
    mask[1, :4] = False  # left padding on row 1
    got = attention_reference(*(jnp.asarray(a, jnp.float32) for a in (q, k, v)), jnp.asarray(mask))
    np.testing.assert_allclose(np.asarray(got), attention_np(q, k, v, mask), rtol=1e-5, atol=1e-5)


def test_attention_rejects_bad_gqa(rng):
    q = jnp.ones((1, 2, 3, 8))
    k = jnp.ones((1, 2, 2, 8))
    with pytest.raises(ValueError, match="3 query heads is not a multiple of 2 kv heads"):
        attention_reference(q, k, k)
