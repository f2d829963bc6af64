"""Roofline of one model forward per decoding window kind: counted FLOPs and bytes, the machine's
measured ceilings, and the fraction of them our real forward reaches.

  python bench/roofline.py                          # CPU default (see below), ~2-3 min on 2 cores
  python bench/roofline.py --layers 16 --dtype bfloat16 --prompt 256 --gen 256 --block 64   # GPU-sized
  python bench/roofline.py --tiny --out /tmp/roofline.json   # seconds; what the tests run
  python bench/roofline.py --preset llada-8b --layers 1 --no-time   # counts, ceilings, XLA check only

Default shape. CPU: preset llada-moe-7b-a1b cut to --layers 2 (real widths: D=2048, 16x128 heads, 64
experts top-8 of width 1024, vocab 157184; 1.49 G params, 6 GB in fp32), fp32, batch 1, prompt 128,
gen 64, block 32 (canvas L=192): one full forward takes about a second on 2 cores. Accelerators:
all layers of the preset, bf16, prompt 256, gen 256, block 64.

What it does
1. Counts (`forward_cost`, usable from other scripts): matmul FLOPs (2 per multiply-add) and the
   fewest bytes one forward must move, per part: embedding rows, q/k/v/o projections, attention
   scores + PV over kv_len keys (bidirectional, GQA), router, the top-k ACTIVE experts (and, apart,
   what our expert path computes: `impl_flops`), dense MLP, LM head for the logits rows the loop asks
   for (decoding/loop.py: the block only), residual-stream activations, KV cache reads (window
   forwards) or writes (full refresh). Weights are read once per forward; experts: only those
   touched, expected E*(1-(1-X/E)^T) for T tokens under uniform independent routing (all E at
   realistic T). Window kinds (`window_shapes`, the canvas laid out as engine.py does): full
   refresh (q_len = kv_len = L), dual (q_len = block, keys over L), prefix (q_len = L - block start,
   mean over blocks), vicinity (prefix_look + block + after_look).
2. Cross-check against XLA's own count: `jax.jit(f).lower(...).compile().cost_analysis()` of the
   same forward, with the all-experts MoE path (fully static) and ONE layer (HloCostAnalysis counts a
   while-loop body once, and nn.scan over layers is a while loop; the tiled expert path is a scan
   too). XLA also counts elementwise ops (norms, RoPE, softmax, SiLU, masks) at 1 flop per element,
   so it lands a little above the matmul count.
3. Ceilings measured here: matmul rate (a large square jnp.dot, fp32 on CPU, bf16 elsewhere,
   median of several, blocked) and copy bandwidth (an in-place x+1 over a 2 GiB buffer, larger than
   the last-level cache, bytes read + written, median).
4. Achieved: median seconds of the real forwards (the module calls the decode loop makes, as in
   bench/bench_loop.py), FLOP/s / peak, bytes/s / bandwidth, floor = max(flops/peak, bytes/bw),
   measured/floor; and the same per part for one layer (--parts).

Random weights; the canvas is random token ids (not masks), so routing spreads over the experts
as the uniform-routing assumption models (all-mask blocks of a random model route alike).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from bench.bench_loop import median_time  # noqa: E402
from dinfer_jax.cache import cache_shape, merge_heads  # noqa: E402
from dinfer_jax.config import ModelConfig  # noqa: E402
from dinfer_jax.families import preset  # noqa: E402
from dinfer_jax.kernels import KernelConfig, expert_impl  # noqa: E402
from dinfer_jax.engine import PROMPT_BUCKET  # noqa: E402

KINDS = ("full", "dual", "prefix", "vicinity")
KIND_NOTES = {"full": "full refresh, q=kv=L", "dual": "dual cache, q=block", "prefix": "prefix cache, q=L-start",
              "vicinity": "vicinity, q=look+block+look"}


# ---------------------------------------------------------------------------------------------
# 1. Analytic counts


def experts_touched(num_experts: int, top_k: int, tokens: int) -> float:
    """Expected distinct experts hit by `tokens` tokens, each routed to top_k of num_experts
    uniformly at random (independent tokens): E * (1 - (1 - X/E)^T)."""
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** tokens)


def expected_padded_rows(tokens: int, num_experts: int, top_k: int, tile: int) -> float:
    """Expected rows the tile-padded expert scan multiplies (pallas_kernels/moe/tiled.py): each
    expert's group padded up to a multiple of `tile`; a group's size is Binomial(T, X/E) under
    uniform routing (a token picks an expert at most once)."""
    p = top_k / num_experts
    if p >= 1.0:
        return float(num_experts * (-(-tokens // tile) * tile))
    total = 0.0
    lq, lp = math.log1p(-p), math.log(p)
    for c in range(1, tokens + 1):
        logpmf = math.lgamma(tokens + 1) - math.lgamma(c + 1) - math.lgamma(tokens - c + 1) + c * lp + (tokens - c) * lq
        if logpmf < -60:
            if c > tokens * p:
                break
            continue
        total += math.exp(logpmf) * (-(-c // tile) * tile)
    return num_experts * total


def moe_impl_for_backend(impl: str = "auto", backend: str | None = None) -> str:
    if impl != "auto":
        return impl
    backend = backend or jax.default_backend()
    return {"tpu": "pallas", "cpu": "tiled"}.get(backend, "ragged")


def forward_cost(cfg: ModelConfig, batch: int, q_len: int, kv_len: int, logits_len: int, *,
                 dtype_bytes: int = 4, cached: bool | None = None, moe_impl: str = "auto",
                 backend: str | None = None, logits_bytes: int = 4, weight_bytes: float | None = None) -> dict:
    """FLOPs and fewest bytes of one forward of `batch` rows with q_len query positions attending to
    kv_len keys and logits for logits_len positions per row.

    cached: keys outside the q_len window come from a KV cache (read); default kv_len != q_len.
    Without a cache the forward's K/V are written out (they become the cache, as in the loop's full
    refresh). dtype_bytes: params/activations/KV; logits are fp32 (logits_bytes). weight_bytes: bytes per
    weight element when the matmul weights (embedding, projections, experts, MLPs, LM head) are stored
    in another format than the activations (int8 / fp8: 1; quantisation scales not counted); default
    dtype_bytes. Routers stay at dtype_bytes.
    MoE stacks with leading dense layers (first_k_dense, width dense_intermediate_size) and shared
    experts (LLaDA2.x) get the parts "dense_mlp" and "shared_experts" (absent otherwise).
    moe_impl: the expert path whose work `impl_flops` describes ("auto" resolves like models/moe.py).

    Returns dict(flops, bytes, impl_flops, parts={name: dict(flops, bytes, impl_flops)}, assumptions).
    flops count the useful work (top-k active experts only); impl_flops what our path computes.
    """
    c = cfg
    B, S, L, G = int(batch), int(q_len), int(kv_len), int(logits_len)
    D, N, K, H, F, V, E, X = (c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size,
                              c.vocab_size, c.num_experts, c.num_experts_per_tok)
    nl = c.num_layers
    T = B * S
    w = dtype_bytes
    wb = dtype_bytes if weight_bytes is None else weight_bytes
    cached = (L != S) if cached is None else cached
    parts: dict[str, dict] = {}

    def add(name, flops, nbytes, impl=None):
        parts[name] = dict(flops=float(flops), bytes=float(nbytes), impl_flops=float(flops if impl is None else impl))

    add("embed", 0, T * D * wb)  # gather of T rows (the write is the first layer's input read)
    qkv_o = 2 * T * D * (2 * N * H + 2 * K * H)
    add("attn_proj", nl * qkv_o, nl * (D * (2 * N * H + 2 * K * H) * wb + ((2 * H if c.qk_norm else 0) + D) * w))
    core = 2 * 2 * B * N * S * L * H  # scores q.k and p.v, every query over every key (bidirectional)
    kv_elems = 2 * B * K * H
    kv_bytes = kv_elems * (L - S) * w if cached else kv_elems * L * w  # read the cache / write the new one
    add("attn_core", nl * core, nl * kv_bytes)
    assumptions = {}
    impl = moe_impl_for_backend(moe_impl, backend)
    if c.is_moe:
        k0 = c.first_k_dense
        if k0:  # leading dense SwiGLU layers; the MoE parts below cover the other nl - k0 layers
            Fd = c.dense_intermediate_size
            add("dense_mlp", k0 * 2 * T * 3 * D * Fd, k0 * 3 * D * Fd * wb)
        nl = nl - k0
        add("router", nl * 2 * T * D * E, nl * D * E * w)
        touched = min(E, experts_touched(E, X, T))
        useful = 2 * T * X * 3 * D * F
        combine = 2 * T * X * D
        if impl == "dense":
            impl_f = 2 * T * E * 3 * D * F + 2 * T * E * D
            assumptions["expert_rows"] = f"dense: all {E} experts for every token"
        elif impl == "tiled":
            from pallas_kernels.moe import tile_rows_for
            tile = tile_rows_for(T * X, E)
            rows = expected_padded_rows(T, E, X, tile)
            impl_f = 2 * rows * 3 * D * F + combine
            assumptions["expert_rows"] = (f"tiled: {T * X} (token, expert) rows padded per expert to tiles of {tile}: "
                                          f"expected {rows:.0f} rows ({rows / (T * X):.2f}x)")
        elif impl == "ragged" and (backend or jax.default_backend()) == "cpu":
            impl_f = 2 * T * X * E * 3 * D * F + combine
            assumptions["expert_rows"] = "ragged on CPU: XLA computes every group densely (E x the rows)"
        else:
            impl_f = useful + combine
            assumptions["expert_rows"] = f"{impl}: the {T * X} routed rows only"
        add("experts", nl * useful, nl * touched * 3 * D * F * wb, nl * impl_f)
        if c.num_shared_experts:  # always-on SwiGLU of width F * num_shared_experts, every token
            Fs = F * c.num_shared_experts
            add("shared_experts", nl * 2 * T * 3 * D * Fs, nl * 3 * D * Fs * wb)
        assumptions["experts_touched"] = (f"{touched:.1f} of {E} per layer: E*(1-(1-X/E)^T), T={T} tokens, "
                                          "uniform independent routing")
    else:
        add("mlp", nl * 2 * T * 3 * D * F, nl * 3 * D * F * wb)
    add("lm_head", 2 * B * G * D * V, D * V * wb + D * w + B * G * V * logits_bytes)
    # residual stream: each layer reads its input and writes its output once (everything inside fused)
    add("activations", 0, c.num_layers * 2 * T * D * w)
    return dict(flops=sum(p["flops"] for p in parts.values()), bytes=sum(p["bytes"] for p in parts.values()),
                impl_flops=sum(p["impl_flops"] for p in parts.values()), parts=parts, assumptions=assumptions,
                shape=dict(batch=B, q_len=S, kv_len=L, logits_len=G, cached=cached, moe_impl=impl))


def bucket_len(n: int) -> int:
    """engine.py's prompt bucketing (prompts padded up to a multiple of PROMPT_BUCKET)."""
    return max(PROMPT_BUCKET, -(-n // PROMPT_BUCKET) * PROMPT_BUCKET)


def canvas_layout(kind: str, prompt_len: int, gen_len: int, prefix_look: int = 16, after_look: int = 16):
    """(gen_start, canvas length) as engine.py lays the canvas out for this cache kind."""
    if kind == "vicinity":
        gs = bucket_len(prompt_len + prefix_look)
        return gs, gs + gen_len + after_look
    gs = bucket_len(prompt_len)
    return gs, gs + gen_len


def window_shapes(kind: str, prompt_len: int, gen_len: int, block: int, prefix_look: int = 16,
                  after_look: int = 16) -> list[tuple[int, int, int]]:
    """[(q_len, kv_len, logits_len)] of the forwards one window kind runs (prefix: one per block,
    the window running from the block start to the canvas end)."""
    gs, L = canvas_layout(kind, prompt_len, gen_len, prefix_look, after_look)
    if kind == "full":
        return [(L, L, block)]
    if kind == "dual":
        return [(block, L, block)]
    if kind == "prefix":
        return [(L - (gs + j * block), L, block) for j in range(gen_len // block)]
    if kind == "vicinity":
        return [(prefix_look + block + after_look, L, block)]
    raise ValueError(f"unknown window kind {kind!r}; choose from {KINDS}")


def kind_cost(cfg: ModelConfig, kind: str, batch: int, prompt_len: int, gen_len: int, block: int, **kw) -> dict:
    """forward_cost of one window kind (prefix: the mean over its blocks' windows)."""
    shapes = window_shapes(kind, prompt_len, gen_len, block, kw.pop("prefix_look", 16), kw.pop("after_look", 16))
    costs = [forward_cost(cfg, batch, q, L, g, cached=(kind != "full"), **kw) for q, L, g in shapes]
    if len(costs) == 1:
        out = costs[0]
    else:
        mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
        out = dict(costs[0])
        for k in ("flops", "bytes", "impl_flops"):
            out[k] = mean([cc[k] for cc in costs])
        out["parts"] = {p: {k: mean([cc["parts"][p][k] for cc in costs]) for k in costs[0]["parts"][p]}
                        for p in costs[0]["parts"]}
        out["shape"] = dict(costs[0]["shape"], q_len=mean([cc["shape"]["q_len"] for cc in costs]))
    out = dict(out, kind=kind)
    return out


# ---------------------------------------------------------------------------------------------
# 2. XLA's own count


def cost_analysis_dict(compiled) -> dict:
    """compiled.cost_analysis() as one dict (older jax returns a list with one dict per program)."""
    ca = compiled.cost_analysis()
    if ca is None:
        return {}
    if isinstance(ca, (list, tuple)):
        ca = ca[0] if ca else {}
    return dict(ca)


def forward_fn(module, kind_window: tuple | None, B: int, Lc: int, gen_start: int, prompt_len: int, block: int):
    """fn(params, canvas_BL, kv) -> logits: the module call the loop makes for one window kind.

    kind_window None: full forward (logits for the block); else (window_offset_from_block_start, size,
    logits_offset) for a cached window forward reading kv."""
    idx = jnp.arange(Lc)
    pad = gen_start - prompt_len
    pos = jnp.broadcast_to(jnp.maximum(idx - pad, 0), (B, Lc)).astype(jnp.int32)
    km = jnp.broadcast_to((idx >= pad) & (idx < Lc), (B, Lc))
    start = jnp.full((B,), gen_start, jnp.int32)

    def sl(x, s, n):
        return jax.vmap(lambda r, s_: jax.lax.dynamic_slice_in_dim(r, s_, n))(x, s)

    if kind_window is None:
        def f(params, canvas, kv=None):
            return module.apply({"params": params}, tokens_BS=canvas, positions_BS=pos, key_mask_BL=km,
                                logits_window=(start, block))
        return f
    off, size, loff = kind_window
    ws = start + off

    def g(params, canvas, kv):
        return module.apply({"params": params}, tokens_BS=sl(canvas, ws, size), positions_BS=sl(pos, ws, size),
                            key_mask_BL=km, kv=kv, window_start=ws,
                            logits_window=(jnp.full((B,), loff, jnp.int32), block))
    return g


def kind_window_args(kind: str, gen_start: int, Lc: int, block: int, prefix_look: int, after_look: int, j: int = 0):
    """The (offset, size, logits_offset) window argument of forward_fn for a kind (prefix: block j)."""
    if kind == "full":
        return None
    if kind == "dual":
        return (0, block, 0)
    if kind == "vicinity":
        return (-prefix_look, prefix_look + block + after_look, prefix_look)
    if kind == "prefix":
        return (j * block, Lc - gen_start - j * block, j * block)
    raise ValueError(kind)


def xla_cost(cfg: ModelConfig, kind: str, batch: int, prompt_len: int, gen_len: int, block: int, dtype,
             moe_impl: str = "dense", attention_impl: str = "auto", prefix_look: int = 16, after_look: int = 16) -> dict:
    """XLA's cost_analysis of the forward (abstract shapes only; nothing is run). Use a 1-layer cfg:
    a scan body is counted once."""
    from dinfer_jax.models import Transformer, abstract_params, unflatten
    gs, Lc = canvas_layout(kind, prompt_len, gen_len, prefix_look, after_look)
    module = Transformer(cfg, dtype, KernelConfig(attention_impl, moe_impl))
    params = unflatten(abstract_params(cfg, dtype))
    f = forward_fn(module, kind_window_args(kind, gs, Lc, block, prefix_look, after_look), batch, Lc, gs,
                   prompt_len, block)
    canvas = jax.ShapeDtypeStruct((batch, Lc), jnp.int32)
    kv_shape = jax.ShapeDtypeStruct(cache_shape(cfg.num_layers, batch, Lc, cfg.num_kv_heads, cfg.head_dim), dtype)
    kv = None if kind == "full" else (kv_shape, kv_shape)
    ca = cost_analysis_dict(jax.jit(f).lower(params, canvas, kv).compile())
    return dict(flops=float(ca.get("flops", float("nan"))), bytes=float(ca.get("bytes accessed", float("nan"))),
                transcendentals=float(ca.get("transcendentals", 0.0)))


def xla_check(cfg: ModelConfig, batch: int, prompt_len: int, gen_len: int, block: int, dtype, kinds=("full", "dual"),
              prefix_look: int = 16, after_look: int = 16) -> list[dict]:
    """Analytic FLOPs (all-experts path) vs XLA's count, on a 1-layer copy of cfg."""
    c1 = cfg.replace(num_layers=1)
    rows = []
    for kind in kinds:
        shapes = window_shapes(kind, prompt_len, gen_len, block, prefix_look, after_look)
        q, L, g = shapes[0]
        ana = forward_cost(c1, batch, q, L, g, dtype_bytes=jnp.dtype(dtype).itemsize, cached=kind != "full",
                           moe_impl="dense")
        x = xla_cost(c1, kind, batch, prompt_len, gen_len, block, dtype, moe_impl="dense",
                     prefix_look=prefix_look, after_look=after_look)
        rows.append(dict(kind=kind, family=cfg.family, layers=1, q_len=q, kv_len=L, logits_len=g,
                         analytic_flops=ana["impl_flops"], xla_flops=x["flops"], xla_bytes=x["bytes"],
                         rel_diff=(x["flops"] - ana["impl_flops"]) / ana["impl_flops"]))
    return rows


# ---------------------------------------------------------------------------------------------
# 3. Ceilings


def measure_matmul_peak(n: int | None = None, dtype=None, repeats: int = 5, sets: int = 3) -> dict:
    """FLOP/s of an n x n x n jnp.dot on random data (rotating over `sets` input pairs), median."""
    cpu = jax.default_backend() == "cpu"
    n = n or (2048 if cpu else 8192)
    dtype = dtype or (jnp.float32 if cpu else jnp.bfloat16)
    keys = jax.random.split(jax.random.key(0), 2 * sets)
    mats = [jax.random.normal(k, (n, n), dtype) for k in keys]
    f = jax.jit(jnp.dot)
    i = [0]

    def call():
        a, b = mats[2 * (i[0] % sets)], mats[2 * (i[0] % sets) + 1]
        i[0] += 1
        return f(a, b)
    secs = median_time(call, repeats, warmup=2)
    return dict(flops_per_s=2 * n ** 3 / secs, n=n, dtype=str(jnp.dtype(dtype)), seconds=secs)


def measure_copy_bandwidth(nbytes: int | None = None, repeats: int = 5) -> dict:
    """Bytes/s of an in-place x + 1 over one large fp32 buffer (donated), bytes read + written, median.
    The default buffer (2 GiB) exceeds the last-level cache of CPUs like this project's (480 MiB L3)."""
    nbytes = nbytes or (2048 << 20)
    n = nbytes // 4
    x = [jax.random.normal(jax.random.key(1), (n,), jnp.float32)]
    f = jax.jit(lambda a: a + 1.0, donate_argnums=0)

    def call():
        x[0] = f(x[0])
        return x[0]
    secs = median_time(call, repeats, warmup=2)
    return dict(bytes_per_s=2 * n * 4 / secs, nbytes=n * 4, seconds=secs)


# ---------------------------------------------------------------------------------------------
# 4. Achieved


def random_params(cfg: ModelConfig, dtype, seed: int = 0, head_scale: float = 1.0) -> dict:
    """init_params under jit (built on the default device, no host copy); LM head times head_scale."""
    from dinfer_jax.models import init_params

    @jax.jit
    def make():
        p = init_params(cfg, seed=seed, dtype=dtype)
        if head_scale != 1.0 and "lm_head" in p:
            p["lm_head"]["unembedding"] = (p["lm_head"]["unembedding"].astype(jnp.float32) * head_scale).astype(dtype)
        return p
    return jax.block_until_ready(make())


def random_canvas(cfg: ModelConfig, batch: int, length: int, seed: int = 0):
    """Random token ids below the special ids (never the mask id)."""
    hi = min(cfg.mask_token_id, cfg.eos_token_id, cfg.vocab_size)
    hi = hi if hi > 2 else cfg.vocab_size - 2
    ids = np.random.RandomState(seed).randint(0, hi, (batch, length)).astype(np.int32)
    ids[ids == cfg.mask_token_id] = 0
    return jnp.asarray(ids)


def time_forwards(cfg, params, dtype, kinds, batch, prompt_len, gen_len, block, repeats, moe_impl="auto",
                  attention_impl="auto", prefix_look=16, after_look=16) -> dict:
    """Median seconds of the real forward per window kind ({kind: seconds}); prefix: the mean over blocks."""
    from dinfer_jax.models import Transformer
    module = Transformer(cfg, dtype, KernelConfig(attention_impl, moe_impl))
    out = {}
    layouts = {}
    for kind in kinds:
        lay = canvas_layout(kind, prompt_len, gen_len, prefix_look, after_look)
        gs, Lc = lay
        if lay not in layouts:  # the cache a window forward reads: this layout's full forward
            canvas = random_canvas(cfg, batch, Lc)
            full = jax.jit(forward_fn(module, None, batch, Lc, gs, prompt_len, block))
            _, kv = full(params, canvas)
            layouts[lay] = (canvas, full, kv)
        canvas, full, kv = layouts[lay]
        if kind == "full":
            out[kind] = median_time(lambda: full(params, canvas)[0], repeats)
            continue
        js = range(gen_len // block) if kind == "prefix" else [0]
        ts = []
        for j in js:
            win = jax.jit(forward_fn(module, kind_window_args(kind, gs, Lc, block, prefix_look, after_look, j),
                                     batch, Lc, gs, prompt_len, block))
            ts.append(median_time(lambda: win(params, canvas, kv)[0], repeats))
        out[kind] = statistics.mean(ts)
    return out


def time_parts(cfg, params, dtype, kind, batch, prompt_len, gen_len, block, repeats, moe_impl="auto",
               attention_impl="auto", prefix_look=16, after_look=16) -> dict:
    """Median seconds of layer 0's pieces at one kind's shapes, standalone on random inputs:
    attention block (projections, qk-norm, RoPE, cache write, core), attention core alone, MoE / MLP
    (router, sort, experts, combine), the expert grouped matmuls alone (MoE), final norm + LM head."""
    from dinfer_jax.models.layers import MLP, Attention, rms_normalize
    from dinfer_jax.models.forward_inputs import ForwardInputs
    from dinfer_jax.models.moe import MoE, route
    from dinfer_jax.kernels import attention
    q, L, g = window_shapes(kind, prompt_len, gen_len, block, prefix_look, after_look)[0]
    c = cfg
    B, D, N, K, H = batch, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim
    layer0 = jax.tree_util.tree_map(lambda a: a[0], params["layers"])
    ks = jax.random.split(jax.random.key(3), 6)
    x = jax.random.normal(ks[0], (B, q, D), dtype)
    pos = jnp.broadcast_to(jnp.arange(L - q, L, dtype=jnp.int32), (B, q))
    km = jnp.ones((B, L), bool)
    kvc = (jax.random.normal(ks[1], (B, L, K, H), dtype), jax.random.normal(ks[2], (B, L, K, H), dtype))
    attn = Attention(c, dtype, KernelConfig(attention=attention_impl))
    cached = kind != "full"
    out = {}
    inputs = ForwardInputs(pos, km, window_start=L - q if cached else None)
    f = jax.jit(lambda p, x, kv: attn.apply({"params": p}, x, inputs, kv=kv if cached else None)[0])
    kv_layer = tuple(merge_heads(t) for t in kvc)  # a layer's cache as it is stored: (B, L, K*H)
    out["attention block"] = median_time(lambda: f(layer0["attn"], x, kv_layer), repeats)
    qq = jax.random.normal(ks[3], (B, q, N, H), dtype)
    core = jax.jit(lambda a, b, v: attention(a, b, v, km, impl=attention_impl))
    out["attention core"] = median_time(lambda: core(qq, *kvc), repeats)
    if c.is_moe:
        moe = MoE(c, dtype, KernelConfig(experts=moe_impl))
        fm = jax.jit(lambda p, x: moe.apply({"params": p}, x))
        out["moe layer"] = median_time(lambda: fm(layer0["mlp"], x), repeats)
        impl = expert_impl(moe_impl)
        if impl in ("tiled", "ragged"):
            from pallas_kernels.moe import swiglu_experts_tiled
            E, X = c.num_experts, c.num_experts_per_tok
            mp = layer0["mlp"]
            x_TD = x.reshape(B * q, D)
            _, ex = route(x_TD, mp["router"], X, c.norm_topk_prob)
            flat = ex.reshape(-1)
            order = jnp.argsort(flat, stable=True)
            xs = jnp.take(x_TD, order // X, axis=0)
            gsz = jnp.bincount(flat, length=E).astype(jnp.int32)
            if impl == "tiled":
                fe = jax.jit(lambda xs, gsz, p: swiglu_experts_tiled(xs, gsz, p["gate_proj"], p["up_proj"],
                                                                     p["down_proj"]))
            else:
                def fe_(xs, gsz, p):
                    gg = jax.lax.ragged_dot(xs, p["gate_proj"], gsz)
                    u = jax.lax.ragged_dot(xs, p["up_proj"], gsz)
                    return jax.lax.ragged_dot(jax.nn.silu(gg) * u, p["down_proj"], gsz)
                fe = jax.jit(fe_)
            out["expert matmuls"] = median_time(lambda: fe(xs, gsz, mp), repeats)
            out["_distinct_experts_layer0"] = int(jnp.sum(gsz > 0))
    else:
        mlp = MLP(c, dtype)
        fm = jax.jit(lambda p, x: mlp.apply({"params": p}, x))
        out["mlp layer"] = median_time(lambda: fm(layer0["mlp"], x), repeats)
    xg = x[:, :g] if g <= q else jax.random.normal(ks[4], (B, g, D), dtype)
    head = params["lm_head"]["unembedding"] if "lm_head" in params else params["embed"]["embedding"]
    fh = jax.jit(lambda xg, s, w: jnp.einsum("bsd,vd->bsv", rms_normalize(xg, s, c.rms_norm_eps), w).astype(jnp.float32))
    out["lm head"] = median_time(lambda: fh(xg, params["final_norm"]["scale"], head), repeats)
    return out


# ---------------------------------------------------------------------------------------------
# CLI


def tiny_configs():
    """Matmul-dominated tiny configs for the XLA check (elementwise work is <2% of the FLOPs)."""
    moe = preset("tiny").replace(vocab_size=1024, hidden_size=256, num_heads=4, num_kv_heads=2, head_dim=64,
                                 intermediate_size=128, num_experts=8, num_experts_per_tok=2, num_layers=2,
                                 mask_token_id=1023, eos_token_id=1022, pad_token_id=1022)
    dense = preset("tiny-dense").replace(vocab_size=1024, hidden_size=256, num_heads=4, num_kv_heads=4, head_dim=64,
                                         intermediate_size=512, num_layers=2, mask_token_id=1023, eos_token_id=1022,
                                         pad_token_id=1022)
    return moe, dense


def print_table(header: list[str], rows: list[list]):
    """A markdown table on stdout."""
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for r in rows:
        print("| " + " | ".join(str(c) for c in r) + " |")


def fmt(x, nd=3):
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return f"{x:.{nd}g}" if abs(x) < 1e4 else f"{x:.0f}"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="llada-moe-7b-a1b")
    ap.add_argument("--layers", type=int, default=None, help="layers kept (default 2 on CPU, all elsewhere)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompt", type=int, default=None, help="prompt length (default 128 CPU / 256 else)")
    ap.add_argument("--gen", type=int, default=None, help="gen length (default 64 CPU / 256 else)")
    ap.add_argument("--block", type=int, default=None, help="block length (default 32 CPU / 64 else)")
    ap.add_argument("--dtype", default=None, help="float32 | bfloat16 (default fp32 on CPU, bf16 else)")
    ap.add_argument("--kinds", nargs="+", default=list(KINDS), help="window kinds counted")
    ap.add_argument("--time-kinds", nargs="+", default=["full", "dual"], help="window kinds timed")
    ap.add_argument("--prefix-look", type=int, default=16)
    ap.add_argument("--after-look", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--moe-impl", default="auto")
    ap.add_argument("--attention-impl", default="auto")
    ap.add_argument("--matmul-n", type=int, default=None)
    ap.add_argument("--copy-mib", type=int, default=None)
    ap.add_argument("--no-time", action="store_true", help="counts, ceilings and the XLA check only")
    ap.add_argument("--no-parts", action="store_true", help="skip the per-part timings")
    ap.add_argument("--parts-kinds", nargs="+", default=None, help="kinds whose parts are timed (default full dual)")
    ap.add_argument("--no-xla-check", action="store_true")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes (tests): seconds on CPU")
    ap.add_argument("--out", default=None, help="write everything as JSON here")
    a = ap.parse_args(argv)

    backend = jax.default_backend()
    cpu = backend == "cpu"
    dtype = jnp.dtype(a.dtype or ("float32" if cpu else "bfloat16"))
    if a.tiny:
        cfg, dense = tiny_configs()
        check_cfgs = [cfg, dense]
        a.batch, a.prompt, a.gen, a.block = a.batch if a.batch != 1 else 2, a.prompt or 96, a.gen or 32, a.block or 16
        a.parts_kinds = a.parts_kinds or ["dual"]
        a.prefix_look, a.after_look = min(a.prefix_look, 8), min(a.after_look, 8)
        a.matmul_n, a.copy_mib, a.repeats = a.matmul_n or 256, a.copy_mib or 8, min(a.repeats, 2)
    else:
        cfg = preset(a.preset)
        cfg = cfg.replace(num_layers=a.layers or (min(2, cfg.num_layers) if cpu else cfg.num_layers))
        check_cfgs = [cfg]
        a.prompt, a.gen, a.block = a.prompt or (128 if cpu else 256), a.gen or (64 if cpu else 256), \
            a.block or (32 if cpu else 64)
    w = dtype.itemsize
    print(f"jax {jax.__version__}, backend {backend}, devices {jax.devices()}")
    print(f"config {a.preset if not a.tiny else 'tiny'}: layers={cfg.num_layers} D={cfg.hidden_size} "
          f"N/K/H={cfg.num_heads}/{cfg.num_kv_heads}/{cfg.head_dim} F={cfg.intermediate_size} "
          f"E/X={cfg.num_experts}/{cfg.num_experts_per_tok} V={cfg.vocab_size}, {cfg.num_params / 1e9:.3f} G params, "
          f"{dtype.name}; batch {a.batch}, prompt {a.prompt}, gen {a.gen}, block {a.block}", flush=True)
    result = dict(jax=jax.__version__, backend=backend, device=str(jax.devices()[0]), dtype=dtype.name,
                  config=cfg.to_dict(), batch=a.batch, prompt=a.prompt, gen=a.gen, block=a.block)

    mm = measure_matmul_peak(a.matmul_n, dtype if not cpu else jnp.float32, repeats=max(3, a.repeats))
    bw = measure_copy_bandwidth((a.copy_mib << 20) if a.copy_mib else None, repeats=max(3, a.repeats))
    peak, bandwidth = mm["flops_per_s"], bw["bytes_per_s"]
    result["ceilings"] = dict(matmul=mm, copy=bw)
    print(f"ceilings: matmul {peak / 1e9:.1f} GFLOP/s ({mm['n']}^3 {mm['dtype']}), "
          f"copy {bandwidth / 1e9:.1f} GB/s ({bw['nbytes'] >> 20} MiB)", flush=True)

    costs = {k: kind_cost(cfg, k, a.batch, a.prompt, a.gen, a.block, dtype_bytes=w, moe_impl=a.moe_impl,
                          prefix_look=a.prefix_look, after_look=a.after_look) for k in a.kinds}
    times = {}
    if not a.no_time:
        params = random_params(cfg, dtype)
        times = time_forwards(cfg, params, dtype, [k for k in a.time_kinds if k in a.kinds], a.batch, a.prompt,
                              a.gen, a.block, a.repeats, a.moe_impl, a.attention_impl, a.prefix_look, a.after_look)
    rows = []
    for k, cst in costs.items():
        t_f, t_b = cst["flops"] / peak, cst["bytes"] / bandwidth
        floor = max(t_f, t_b)
        r = dict(kind=k, q_len=cst["shape"]["q_len"], kv_len=cst["shape"]["kv_len"], logits_len=cst["shape"]["logits_len"],
                 flops=cst["flops"], impl_flops=cst["impl_flops"], bytes=cst["bytes"], intensity=cst["flops"] / cst["bytes"],
                 floor_flops_s=t_f, floor_bytes_s=t_b, floor_s=floor, bound="FLOPs" if t_f >= t_b else "bytes",
                 parts=cst["parts"], assumptions=cst["assumptions"])
        if k in times:
            s = times[k]
            r.update(measured_s=s, frac_peak=cst["flops"] / s / peak, frac_impl_peak=cst["impl_flops"] / s / peak,
                     frac_bw=cst["bytes"] / s / bandwidth, measured_over_floor=s / floor)
        rows.append(r)
    result["kinds"] = rows

    parts_rows = []
    if not a.no_time and not a.no_parts:
        for kind in [k for k in (a.parts_kinds or ["full", "dual"]) if k in ("full", "dual")]:
            pt = time_parts(cfg, params, dtype, kind, a.batch, a.prompt, a.gen, a.block, a.repeats, a.moe_impl,
                            a.attention_impl, a.prefix_look, a.after_look)
            cst = forward_cost(cfg.replace(num_layers=1), a.batch, *window_shapes(kind, a.prompt, a.gen, a.block)[0],
                               dtype_bytes=w, cached=kind != "full", moe_impl=a.moe_impl)
            P = cst["parts"]
            mlp_key = "experts" if cfg.is_moe else "mlp"
            router = P.get("router", dict(flops=0, bytes=0, impl_flops=0))
            spans = {
                "attention block": [P["attn_proj"], P["attn_core"]],
                "attention core": [P["attn_core"]],
                "moe layer": [P[mlp_key], router], "mlp layer": [P[mlp_key]],
                "expert matmuls": [P[mlp_key]],
                "lm head": [P["lm_head"]],
            }
            for name, secs in pt.items():
                if name.startswith("_"):
                    continue
                fl = sum(p["flops"] for p in spans[name])
                ifl = sum(p["impl_flops"] for p in spans[name])
                by = sum(p["bytes"] for p in spans[name])
                floor = max(fl / peak, by / bandwidth)
                parts_rows.append(dict(kind=kind, part=name, layers_in_forward=1 if name == "lm head" else cfg.num_layers,
                                       flops=fl, impl_flops=ifl, bytes=by, floor_s=floor, measured_s=secs,
                                       frac_peak=fl / secs / peak, frac_impl_peak=ifl / secs / peak,
                                       frac_bw=by / secs / bandwidth, measured_over_floor=secs / floor))
            if "_distinct_experts_layer0" in pt:
                result.setdefault("distinct_experts_layer0", {})[kind] = pt["_distinct_experts_layer0"]
    result["parts"] = parts_rows

    checks = []
    if not a.no_xla_check:
        for cc in check_cfgs:
            checks += xla_check(cc, a.batch, a.prompt, a.gen, a.block, dtype, kinds=("full", "dual"),
                                prefix_look=a.prefix_look, after_look=a.after_look)
    result["xla_check"] = checks

    if a.out:
        os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)

    print(f"\n### Ceilings ({backend})\n\n| matmul {mm['n']}^3 {mm['dtype']} | copy {bw['nbytes'] >> 20} MiB |\n|---|---|\n"
          f"| {peak / 1e9:.1f} GFLOP/s | {bandwidth / 1e9:.1f} GB/s |")
    print("\n### Per forward, by window kind (FLOPs = useful: top-k experts; impl = what our path computes)\n")
    print("| kind | q / kv / logits | GFLOP | impl GFLOP | GB min | FLOP/B | floor ms | bound | measured ms | "
          "% peak (impl) | % bw | meas/floor |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        m = r.get("measured_s")
        print(f"| {r['kind']} | {fmt(r['q_len'])} / {r['kv_len']} / {r['logits_len']} | {fmt(r['flops'] / 1e9)} | "
              f"{fmt(r['impl_flops'] / 1e9)} | {fmt(r['bytes'] / 1e9)} | {fmt(r['intensity'])} | "
              f"{fmt(r['floor_s'] * 1e3)} | {r['bound']} | {fmt(m * 1e3) if m else '-'} | "
              + (f"{100 * r['frac_peak']:.1f} ({100 * r['frac_impl_peak']:.1f}) | {100 * r['frac_bw']:.1f} | "
                 f"{r['measured_over_floor']:.2f} |" if m else "- | - | - |"))
    if rows:
        print("\nassumptions: " + "; ".join(f"{k}: {v}" for k, v in rows[0]["assumptions"].items())
              + (" (for the first kind)" if len(rows) > 1 else ""))
    if parts_rows:
        print("\n### Layer-0 parts, standalone (x layers in the forward, except the LM head)\n")
        print_table(["kind", "part", "GFLOP", "impl GFLOP", "MB min", "floor ms", "measured ms", "% peak (impl)",
                     "% bw", "meas/floor"],
                    [[r["kind"], r["part"], fmt(r["flops"] / 1e9), fmt(r["impl_flops"] / 1e9), fmt(r["bytes"] / 1e6),
                      fmt(r["floor_s"] * 1e3), fmt(r["measured_s"] * 1e3),
                      f"{100 * r['frac_peak']:.1f} ({100 * r['frac_impl_peak']:.1f})", f"{100 * r['frac_bw']:.1f}",
                      f"{r['measured_over_floor']:.2f}"] for r in parts_rows])
        if "distinct_experts_layer0" in result:
            print(f"\ndistinct experts hit in layer 0 (random inputs): {result['distinct_experts_layer0']}")
    if checks:
        print("\n### Analytic FLOPs vs XLA cost_analysis (1 layer, all-experts MoE path, fully static)\n")
        print_table(["family", "kind", "q / kv / logits", "analytic GFLOP", "XLA GFLOP", "XLA - analytic"],
                    [[r["family"], r["kind"], f"{r['q_len']} / {r['kv_len']} / {r['logits_len']}",
                      fmt(r["analytic_flops"] / 1e9, 5), fmt(r["xla_flops"] / 1e9, 5), f"{100 * r['rel_diff']:+.2f}%"]
                     for r in checks])
    return result


if __name__ == "__main__":
    main()
