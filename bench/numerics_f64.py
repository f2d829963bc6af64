"""Issue 19: fp32 rounding error of our forward vs the PyTorch peer's, against a float64 reference.

  python bench/numerics_f64.py                    # medium LLaDA dense, 1 and 8 layers, 256 tokens
  XLA_FLAGS=--xla_cpu_experimental_ynn_fusion_type= python bench/numerics_f64.py --ours-only  # dots via Eigen
  python bench/numerics_f64.py --ops              # per-op fp32 error vs float64: ours vs torch vs numpy

Model: LLaDA dense (family llada), d_model 1024, 16 heads x 64, MHA, SwiGLU 2816, vocab 32000
(168 M params at 8 layers), rope_theta 500000, eps 1e-5; random weights as bench/compare_torch.py
(normal(0, 0.02), norm scales 1, numpy seed 0) with the LM head x40 (peaky logits, bench_loop.py),
or (--init hf) tests/hf_reference.py's: normal(0, 0.1), norm scales 1 + normal(0, 0.1).
Input: one 256-token canvas of random ids, full bidirectional attention.

Forwards (same weights):
  f64      an independent numpy float64 forward written from the formulas (RoPE angles in float64);
  torch64  transformers LlamaForCausalLM in float64 (eager attention, 4-D zero additive mask);
  ours     dinfer_jax Model.logits in fp32 (attention_impl "auto" = the XLA path on CPU);
  torch32  the same LlamaForCausalLM in fp32.
Reported: mean / max |logits - f64 logits|, and the same against torch.double() (issue 19's first reference).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


def medium_config(layers: int = 8, hidden: int = 1024, heads: int = 16, mlp: int = 2816, vocab: int = 32000):
    from dinfer_jax.families import preset
    return preset("llada-8b").replace(
        vocab_size=vocab, hidden_size=hidden, num_layers=layers, num_heads=heads, num_kv_heads=heads,
        head_dim=hidden // heads, intermediate_size=mlp, max_position_embeddings=4096,
        mask_token_id=vocab - 1, eos_token_id=vocab - 2, pad_token_id=vocab - 2, eot_token_id=vocab - 3)


def random_params(cfg, seed: int = 0, init: str = "bench") -> dict:
    """Flat fp32 params. init "bench": normal(0, 0.02), norm scales 1, LM head x40 (as
    compare_torch.py / bench_loop.py); "hf": tests/hf_reference.py's _randomize, every weight
    normal(0, 0.1), norm scales 1 + normal(0, 0.1) (activations grow layer by layer)."""
    import jax
    from dinfer_jax.models import flatten, init_params
    shapes = flatten(jax.eval_shape(lambda: init_params(cfg, seed)))
    rng = np.random.default_rng(seed)
    std = {"bench": 0.02, "hf": 0.1}[init]
    out = {}
    for k, v in shapes.items():
        noise = (np.ascontiguousarray(rng.standard_normal(v.shape[::-1], np.float32).T) if k.endswith("unembedding")
                 else rng.standard_normal(v.shape, np.float32)) * np.float32(std)
        out[k] = ((np.float32(1) + noise) if init == "hf" else np.ones(v.shape, np.float32)) if k.endswith("scale") \
            else noise
    if init == "bench":
        out["lm_head/unembedding"] = out["lm_head/unembedding"] * np.float32(40.0)
    return out


# ------------------------------------------------------------------------------- float64 reference

def forward_np(cfg, p: dict, ids: np.ndarray, dtype=np.float64) -> np.ndarray:
    """ids (B, S) -> logits (B, S, V), every op in `dtype` (float64: the reference), from the formulas."""
    f = lambda a: np.asarray(a, dtype)  # noqa: E731
    D, N, H, eps = cfg.hidden_size, cfg.num_heads, cfg.head_dim, cfg.rms_norm_eps
    K = cfg.num_kv_heads
    B, S = ids.shape

    def norm(x, w):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w

    half = cfg.rotary // 2
    inv = np.float64(cfg.rope_theta) ** (-np.arange(0, cfg.rotary, 2, dtype=np.float64) / cfg.rotary)
    ang = np.arange(S, dtype=np.float64)[:, None] * inv  # (S, half)
    cos, sin = f(np.cos(ang))[None, :, None], f(np.sin(ang))[None, :, None]

    def rope(x):
        x1, x2 = x[..., :half], x[..., half:cfg.rotary]
        return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin, x[..., cfg.rotary:]], -1)

    x = f(p["embed/embedding"])[ids]
    for l in range(cfg.num_layers):
        g = lambda name: f(p[f"layers/{name}"][l])  # noqa: E731
        h = norm(x, g("attn_norm/scale"))
        q = rope(np.einsum("bsd,dnh->bsnh", h, g("attn/q_proj")))
        k = rope(np.einsum("bsd,dkh->bskh", h, g("attn/k_proj")))
        v = np.einsum("bsd,dkh->bskh", h, g("attn/v_proj"))
        k, v = np.repeat(k, N // K, 2), np.repeat(v, N // K, 2)
        s = np.einsum("bsnh,blnh->bnsl", q, k) / np.sqrt(dtype(H))
        e = np.exp(s - s.max(-1, keepdims=True))
        a = np.einsum("bnsl,blnh->bsnh", e / e.sum(-1, keepdims=True), v)
        x = x + np.einsum("bsnh,nhd->bsd", a, g("attn/o_proj"))
        m = norm(x, g("mlp_norm/scale"))
        gate, up = m @ g("mlp/gate_proj"), m @ g("mlp/up_proj")
        x = x + (gate / (1 + np.exp(-gate)) * up) @ g("mlp/down_proj")
    x = norm(x, f(p["final_norm/scale"]))
    return x @ f(p["lm_head/unembedding"]).T


# ---------------------------------------------------------------------------------------- torch peer

def torch_model(cfg, p: dict, dtype: str = "float32"):
    """transformers LlamaForCausalLM with our weights (LLaDA dense == Llama, bidirectional via mask)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    hf = LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim, rms_norm_eps=cfg.rms_norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
        max_position_embeddings=cfg.max_position_embeddings, tie_word_embeddings=False, attention_bias=False,
        mlp_bias=False, attn_implementation="eager")
    model = LlamaForCausalLM(hf).eval()
    D = cfg.hidden_size
    sd = {"model.embed_tokens.weight": p["embed/embedding"], "model.norm.weight": p["final_norm/scale"],
          "lm_head.weight": p["lm_head/unembedding"]}
    for l in range(cfg.num_layers):
        g = lambda name: p[f"layers/{name}"][l]  # noqa: E731
        pre = f"model.layers.{l}."
        sd[pre + "input_layernorm.weight"] = g("attn_norm/scale")
        sd[pre + "post_attention_layernorm.weight"] = g("mlp_norm/scale")
        for n in "qkv":
            sd[pre + f"self_attn.{n}_proj.weight"] = g(f"attn/{n}_proj").reshape(D, -1).T
        sd[pre + "self_attn.o_proj.weight"] = g("attn/o_proj").reshape(-1, D).T
        for n in ("gate", "up", "down"):
            sd[pre + f"mlp.{n}_proj.weight"] = g(f"mlp/{n}_proj").T
    missing, unexpected = model.load_state_dict(
        {k: torch.from_numpy(np.ascontiguousarray(v, np.float32)) for k, v in sd.items()}, strict=False)
    assert not unexpected and all("rotary" in m for m in missing), (missing, unexpected)
    return model.to(getattr(torch, dtype))


def torch_logits(model, ids: np.ndarray) -> np.ndarray:
    import torch
    B, S = ids.shape
    dt = next(model.parameters()).dtype
    with torch.no_grad():
        out = model(input_ids=torch.as_tensor(ids, dtype=torch.long),
                    attention_mask=torch.zeros(B, 1, S, S, dtype=dt)).logits
    return out.double().numpy()


def ours_logits(cfg, p: dict, ids: np.ndarray, attention_impl: str = "auto") -> np.ndarray:
    import jax.numpy as jnp
    from dinfer_jax.model import Model
    from dinfer_jax.models import unflatten
    model = Model(cfg, unflatten({k: jnp.asarray(v, jnp.float32) for k, v in p.items()}),
                  attention_impl=attention_impl)
    return np.asarray(model.logits(ids), np.float64)


def err(a, ref) -> dict:
    d = np.abs(np.asarray(a, np.float64) - ref)
    return {"mean": float(d.mean()), "max": float(d.max())}


def measure(cfg, p, ids, with_torch: bool = True) -> dict:
    """Errors of each forward against the float64 forward, and against torch.double() (the
    reference issue 19 first used: not float64 throughout, see RESULTS.md)."""
    ref = forward_np(cfg, p, ids)
    ours = ours_logits(cfg, p, ids)
    out = {"scale": float(np.abs(ref).mean()), "vs float64": {"ours fp32": err(ours, ref)}}
    if not with_torch:
        return out
    m = torch_model(cfg, p, "float32")
    t32 = torch_logits(m, ids)
    t64 = torch_logits(m.double(), ids)
    out["vs float64"].update({"torch fp32": err(t32, ref), "torch.double()": err(t64, ref)})
    out["vs torch.double()"] = {"ours fp32": err(ours, t64), "torch fp32": err(t32, t64)}
    return out


def op_table(seed: int = 0):
    """Relative mean fp32 error vs float64 of single matmuls (x N(0,1), w N(0,0.02), 256 rows):
    XLA:CPU (ours) vs torch (MKL) vs numpy (OpenBLAS)."""
    import jax
    import torch
    rng = np.random.default_rng(seed)
    print("matmul (256 x K) @ (K x N): mean |err| / mean |result|")
    for K, N in [(256, 256), (704, 256), (1024, 1024), (2816, 1024), (1024, 32000)]:
        x = rng.standard_normal((256, K)).astype(np.float32)
        w = (rng.standard_normal((K, N)) * 0.02).astype(np.float32)
        ref = x.astype(np.float64) @ w.astype(np.float64)
        s = np.abs(ref).mean()
        rel = lambda a: np.abs(np.asarray(a, np.float64) - ref).mean() / s  # noqa: E731
        print(f"  K {K:5d} N {N:6d}  XLA:CPU {rel(jax.jit(lambda a, b: a @ b)(x, w)):.3e}  "
              f"torch {rel((torch.from_numpy(x) @ torch.from_numpy(w)).numpy()):.3e}  numpy {rel(x @ w):.3e}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--init", nargs="+", default=["bench", "hf"], choices=["bench", "hf"])
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ours-only", action="store_true", help="skip the torch peer (e.g. under other XLA_FLAGS)")
    ap.add_argument("--ops", action="store_true", help="only the per-matmul table (op_table)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.ops:
        print(f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}")
        return op_table()
    if not args.ours_only:
        import torch
        torch.set_num_threads(args.threads)
    print(f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}")
    results = {}
    for init in args.init:
        for L in args.layers:
            cfg = medium_config(L)
            p = random_params(cfg, init=init)
            ids = np.random.RandomState(0).randint(0, cfg.vocab_size - 3, (1, args.seq)).astype(np.int32)
            r = measure(cfg, p, ids, with_torch=not args.ours_only)
            results[f"{init} init, {L} layers"] = r
            print(f"== init {init}, {L} layer(s), d {cfg.hidden_size}, vocab {cfg.vocab_size}, {args.seq} tokens; "
                  f"mean |f64 logit| {r['scale']:.3g}")
            for refname in ("vs float64", "vs torch.double()"):
                for k, v in r.get(refname, {}).items():
                    print(f"  {refname:18s} {k:15s} mean {v['mean']:.3e}  max {v['max']:.3e}")
    if args.out:
        with open(args.out, "w") as fh:
            json.dump({"xla_flags": os.environ.get("XLA_FLAGS", ""), "results": results}, fh, indent=1)


if __name__ == "__main__":
    main()
