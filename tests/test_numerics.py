"""Issue 19: fp32 rounding of our forward against a float64 reference (bench/numerics_f64.py).

The reference is an independent numpy float64 forward (RoPE angles, norms, softmax all in float64).
transformers' LlamaForCausalLM in float64 is NOT one: its RoPE inv_freq is computed in fp32 and its
angles under autocast-off fp32, LlamaRMSNorm casts to fp32, eager softmax runs in fp32; torch fp32
shares those roundings, which is what made our error look ~4x torch's (RESULTS.md, issue 19).
Against the true float64 forward, our own ops (RMSNorm, RoPE, attention, SiLU) match or beat torch's;
what remains is the fp32 dot: XLA:CPU's (YNNPACK / Eigen, like numpy's OpenBLAS) accumulates with
1.3-1.6x the rounding of torch's MKL sgemm, measured per matmul.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bench.numerics_f64 import err, forward_np, medium_config, ours_logits, random_params

SEQ = 128


@pytest.fixture(scope="module")
def small():
    """1 layer, d 256 (4 heads x 64), SwiGLU 704, vocab 4096, LM head x40 (bench init)."""
    cfg = medium_config(1, hidden=256, heads=4, mlp=704, vocab=4096)
    p = random_params(cfg)
    ids = np.random.RandomState(0).randint(0, cfg.vocab_size - 3, (1, SEQ)).astype(np.int32)
    return cfg, p, ids, forward_np(cfg, p, ids)


@pytest.mark.smoke
def test_fp32_forward_error_vs_float64(small):
    cfg, p, ids, ref = small
    e = err(ours_logits(cfg, p, ids), ref)
    # Measured (jax 0.10.2, CPU): ours 5.96e-6 mean, torch fp32 4.27e-6, mean |logit| 10.2. Bound:
    # torch's x 1.6 (XLA:CPU's fp32 dot vs MKL's, per matmul) x ~1.5 slack = 1e-5; a real defect
    # (fp32 -> bf16 anywhere, a wrong RoPE angle) is orders of magnitude above it.
    assert e["mean"] <= 1e-5, e
    assert e["mean"] / np.abs(ref).mean() <= 1e-6, e


def test_fp32_forward_error_vs_torch_peer(small):
    pytest.importorskip("transformers")
    from bench.numerics_f64 import torch_logits, torch_model
    cfg, p, ids, ref = small
    ours = err(ours_logits(cfg, p, ids), ref)["mean"]
    torch32 = err(torch_logits(torch_model(cfg, p, "float32"), ids), ref)["mean"]
    # The only remaining gap is the fp32 dot (module doc): <= 1.6x (measured 1.40x here).
    assert ours <= 1.6 * torch32, (ours, torch32)


def test_own_ops_not_worse_than_torch():
    """Each op that is ours (not a matmul library's): fp32 error vs float64 <= torch's (+ slack)."""
    torch = pytest.importorskip("torch")
    from transformers.models.llama import modeling_llama as ml
    import flax.linen as nn
    from dinfer_jax.models.layers import rms_normalize, rotary_embedding
    from pallas_kernels.attention import attention_reference
    rng = np.random.default_rng(0)
    S, N, H, D = 256, 4, 64, 256
    f32 = lambda a: np.asarray(a, np.float32)  # noqa: E731

    def e(a, ref):
        return float(np.abs(np.asarray(a, np.float64) - ref).mean())
    ratios = {}
    # RMSNorm
    x = f32(rng.standard_normal((S, D)) * 0.5)
    x64 = x.astype(np.float64)
    ref = x64 / np.sqrt((x64 ** 2).mean(-1, keepdims=True) + 1e-5)
    with torch.no_grad():
        t = ml.LlamaRMSNorm(D, 1e-5)(torch.from_numpy(x)).numpy()
    ratios["rmsnorm"] = e(rms_normalize(jnp.asarray(x), jnp.ones(D), 1e-5), ref) / e(t, ref)
    # RoPE (theta 500000, positions 0..255): float64 angles in the reference
    q = f32(rng.standard_normal((1, S, N, H)))
    pos = np.arange(S)[None]
    ang = pos[0][:, None] * 500000.0 ** (-np.arange(0, H, 2) / H)
    cos, sin = np.cos(ang)[None, :, None], np.sin(ang)[None, :, None]
    q64 = q.astype(np.float64)
    h = H // 2
    ref = np.concatenate([q64[..., :h] * cos - q64[..., h:] * sin, q64[..., h:] * cos + q64[..., :h] * sin], -1)
    hf = ml.LlamaConfig(hidden_size=N * H, num_attention_heads=N, head_dim=H,
                        rope_parameters={"rope_type": "default", "rope_theta": 500000.0})
    with torch.no_grad():
        c, s = ml.LlamaRotaryEmbedding(hf)(torch.from_numpy(q), torch.from_numpy(pos))
        tq = ml.apply_rotary_pos_emb(torch.from_numpy(q).transpose(1, 2), torch.from_numpy(q).transpose(1, 2), c, s)[0]
    ratios["rope"] = e(rotary_embedding(jnp.asarray(q), jnp.asarray(pos), 500000.0, H), ref) / e(
        tq.transpose(1, 2).numpy(), ref)
    # attention core
    q, k, v = (f32(rng.standard_normal((1, S, N, H)) * sc) for sc in (2, 2, 1))
    q64, k64, v64 = (a.astype(np.float64) for a in (q, k, v))
    sc = np.einsum("bsnh,blnh->bnsl", q64, k64) / np.sqrt(H)
    pr = np.exp(sc - sc.max(-1, keepdims=True))
    ref = np.einsum("bnsl,blnh->bsnh", pr / pr.sum(-1, keepdims=True), v64)

    class Mod(torch.nn.Module):
        num_key_value_groups = 1
    with torch.no_grad():
        to = ml.eager_attention_forward(Mod().eval(), *(torch.from_numpy(a).transpose(1, 2) for a in (q, k, v)),
                                        torch.zeros(1, 1, S, S), scaling=H ** -0.5)[0]
    ratios["attention"] = e(attention_reference(q, k, v), ref) / e(to.numpy(), ref)
    # SiLU
    g = f32(rng.standard_normal((S, 704)) * 2)
    ref = g.astype(np.float64) / (1 + np.exp(-g.astype(np.float64)))
    ratios["silu"] = e(jax.jit(nn.silu)(g), ref) / e(torch.nn.functional.silu(torch.from_numpy(g)).numpy(), ref)
    # Measured: rmsnorm 0.91, rope 1.00, attention 1.04 (its two dots), silu 1.11 (XLA's logistic).
    assert all(r <= 1.25 for r in ratios.values()), ratios
