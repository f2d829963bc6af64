"""The Gemma-4 text stack run two ways over one set of weights (DiffusionGemma): a causal ENCODER that
fills a KV cache and a bidirectional DECODER that reads it and returns logits for a canvas.
The layer formula, masks and param tree: docs/internals/model_code.md.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp

from dinfer_jax.models.expert_parallel import moe_expert_parallel
from dinfer_jax.models.layers import param
from dinfer_jax.models.moe import _sorted_experts
from dinfer_jax.models.quant import ragged_matmul
from dinfer_jax.sharding import batch_axes

SLIDING, FULL = "sliding_attention", "full_attention"


@dataclasses.dataclass(frozen=True)
class Gemma4Config:
    """The text stack's shapes and constants (hashable: a static jit argument)."""
    vocab_size: int
    hidden_size: int
    intermediate_size: int  # dense MLP and self-conditioning width I
    num_heads: int
    layer_types: tuple[str, ...]
    sliding_kv_heads: int
    sliding_head_dim: int
    full_kv_heads: int
    full_head_dim: int
    num_experts: int
    top_k_experts: int
    moe_intermediate_size: int
    sliding_window: int
    sliding_rope_theta: float = 1e4
    full_rope_theta: float = 1e6
    full_partial_rotary_factor: float = 0.25
    rms_norm_eps: float = 1e-6
    final_logit_softcapping: float | None = 30.0
    decoder_window: int | None = None  # cache slots a sliding decoder layer reads (None: sliding_window - 1)

    def __post_init__(self):
        bad = [t for t in self.layer_types if t not in (SLIDING, FULL)]
        if bad:
            raise ValueError(f"layer_types: unknown kind {bad[0]!r} (expected {SLIDING!r} or {FULL!r})")
        for kind, k in ((SLIDING, self.sliding_kv_heads), (FULL, self.full_kv_heads)):
            if kind in self.layer_types and self.num_heads % k:
                raise ValueError(f"num_heads={self.num_heads} is not a multiple of the {kind} KV heads {k}")
        if not 0 < self.top_k_experts <= self.num_experts:
            raise ValueError(f"top_k_experts={self.top_k_experts} must be in [1, num_experts={self.num_experts}]")

    @property
    def num_layers(self) -> int:
        return len(self.layer_types)

    def kv_shape(self, kind: str) -> tuple[int, int]:
        """(K, H) of a layer kind."""
        return (self.sliding_kv_heads, self.sliding_head_dim) if kind == SLIDING else (self.full_kv_heads,
                                                                                       self.full_head_dim)

    def inv_freq(self, kind: str) -> jnp.ndarray:
        """(H/2,) RoPE inverse frequencies: sliding theta^(-2j/H); full: "proportional" (the rest 0)."""
        _, H = self.kv_shape(kind)
        theta = self.sliding_rope_theta if kind == SLIDING else self.full_rope_theta
        freqs = 1.0 / (theta ** (jnp.arange(0, H, 2, dtype=jnp.float32) / H))
        if kind == FULL:
            n = int(self.full_partial_rotary_factor * H // 2)
            freqs = jnp.where(jnp.arange(H // 2) < n, freqs, 0.0)
        return freqs

    @property
    def embed_scale(self) -> float:
        return math.sqrt(self.hidden_size)


@flax.struct.dataclass
class EncoderCache:
    """Per-layer K/V (B, T, K_l, H_l) for T slots (post-norm, post-RoPE K; normed V), `valid` (B, T)
    slots holding real tokens (False: padding or not yet written), `length` () slots written."""
    k: tuple
    v: tuple
    valid: jax.Array
    length: jax.Array

    @classmethod
    def empty(cls, cfg: Gemma4Config, batch: int, slots: int, dtype=jnp.float32) -> "EncoderCache":
        shapes = [(batch, slots, *cfg.kv_shape(t)) for t in cfg.layer_types]
        return cls(k=tuple(jnp.zeros(s, dtype) for s in shapes), v=tuple(jnp.zeros(s, dtype) for s in shapes),
                   valid=jnp.zeros((batch, slots), bool), length=jnp.zeros((), jnp.int32))


def rms_norm(x, weight=None, eps: float = 1e-6):
    """x * (mean(x^2) + eps)^-0.5 (* weight) in fp32, cast back to x.dtype."""
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    if weight is not None:
        y = y * weight.astype(jnp.float32)
    return y.astype(x.dtype)


def rope(x_BSnH, positions_BS, inv_freq):
    """NeoX rotate-half RoPE over the whole head dim with (H/2,) inv_freq (zeros pass through)."""
    ang = positions_BS.astype(jnp.float32)[..., None] * inv_freq  # (B, S, H/2)
    ang = jnp.concatenate([ang, ang], axis=-1)[:, :, None, :]
    cos, sin = jnp.cos(ang).astype(x_BSnH.dtype), jnp.sin(ang).astype(x_BSnH.dtype)
    half = x_BSnH.shape[-1] // 2
    rotated = jnp.concatenate([-x_BSnH[..., half:], x_BSnH[..., :half]], axis=-1)
    return x_BSnH * cos + rotated * sin


def attend(q_BSNH, k_BTKH, v_BTKH, mask_BST):
    """Softmax(q k^T) v with scale 1 (q/k are RMS-normed), GQA by grouping query heads, fp32 softmax."""
    B, S, N, H = q_BSNH.shape
    K = k_BTKH.shape[2]
    q = q_BSNH.reshape(B, S, K, N // K, H)
    s = jnp.einsum("bskgh,btkh->bkgst", q, k_BTKH, preferred_element_type=jnp.float32)
    s = jnp.where(mask_BST[:, None, None], s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1).astype(v_BTKH.dtype)
    o = jnp.einsum("bkgst,btkh->bskgh", p, v_BTKH)
    return o.reshape(B, S, N, H)


def _norm(module, name, dim, dtype, x, eps):
    return rms_norm(x, param(module, name, (dim,), ("embed",), dtype, nn.initializers.ones), eps)


class Gemma4Layer(nn.Module):
    """One layer. __call__(x_BSD, positions_BS, kv, mask_BST, encode) -> (y_BSD, (k, v)): encode=True
    writes this call's K/V into kv = (k_BTKH, v_BTKH) at slots positions_BS[0] and attends over the
    result; encode=False attends over kv ++ this call's K/V."""
    cfg: Gemma4Config
    kind: str
    dtype: jnp.dtype = jnp.float32
    mesh: Any = None  # expert parallelism for the experts (None: one device's path)

    @nn.compact
    def __call__(self, x_BSD, positions_BS, kv, mask_BST, encode: bool):
        c, dt = self.cfg, self.dtype
        D, eps = c.hidden_size, c.rms_norm_eps
        a_in = _norm(self, "input_norm", D, dt, x_BSD, eps)
        out, new_kv = _Attention(c, self.kind, dt, name="attn")(a_in, positions_BS, kv, mask_BST, encode)
        r = x_BSD + _norm(self, "post_attn_norm", D, dt, out, eps)
        dense = _GeluMLP(D, c.intermediate_size, dt, name="mlp")(_norm(self, "pre_ffn_norm", D, dt, r, eps))
        moe = _Experts(c, dt, self.mesh, name="experts")(_norm(self, "pre_ffn_norm_2", D, dt, r, eps), r,
                                                         _Router(c, dt, name="router")())
        ffn = _norm(self, "post_ffn_norm_1", D, dt, dense, eps) + _norm(self, "post_ffn_norm_2", D, dt, moe, eps)
        y = r + _norm(self, "post_ffn_norm", D, dt, ffn, eps)
        scalar = param(self, "encoder_scalar" if encode else "decoder_scalar", (1,), (None,), dt, nn.initializers.ones)
        return y * scalar.astype(y.dtype), new_kv


class _Attention(nn.Module):
    """q/k/v RMSNorm, RoPE of the layer kind, scale-1 softmax over the cache: x_BSD -> (y_BSD, (k, v))."""
    cfg: Gemma4Config
    kind: str
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x_BSD, positions_BS, kv, mask_BST, encode: bool):
        c, dt = self.cfg, self.dtype
        D, N = c.hidden_size, c.num_heads
        K, H = c.kv_shape(self.kind)
        wq = param(self, "q_proj", (D, N, H), ("embed", "heads", "head_dim"), dt)
        wk = param(self, "k_proj", (D, K, H), ("embed", "kv_heads", "head_dim"), dt)
        wo = param(self, "o_proj", (N, H, D), ("heads", "head_dim", "embed"), dt)
        ones = nn.initializers.ones
        q = rms_norm(jnp.einsum("bsd,dnh->bsnh", x_BSD, wq),
                     param(self, "q_norm", (H,), ("head_dim",), dt, ones), c.rms_norm_eps)
        k_raw = jnp.einsum("bsd,dkh->bskh", x_BSD, wk)
        if self.kind == SLIDING:
            v = jnp.einsum("bsd,dkh->bskh", x_BSD, param(self, "v_proj", (D, K, H), ("embed", "kv_heads", "head_dim"), dt))
        else:
            v = k_raw  # full layers: V is the raw k projection (before k_norm and RoPE)
        k = rms_norm(k_raw, param(self, "k_norm", (H,), ("head_dim",), dt, ones), c.rms_norm_eps)
        v = rms_norm(v, None, c.rms_norm_eps)
        inv_freq = c.inv_freq(self.kind)
        q, k = rope(q, positions_BS, inv_freq), rope(k, positions_BS, inv_freq)
        k_cache, v_cache = kv
        if encode:
            start = positions_BS[0, 0]
            k_all = jax.lax.dynamic_update_slice_in_dim(k_cache, k.astype(k_cache.dtype), start, axis=1)
            v_all = jax.lax.dynamic_update_slice_in_dim(v_cache, v.astype(v_cache.dtype), start, axis=1)
            new_kv = (k_all, v_all)
        else:
            k_all = jnp.concatenate([k_cache, k.astype(k_cache.dtype)], axis=1)
            v_all = jnp.concatenate([v_cache, v.astype(v_cache.dtype)], axis=1)
            new_kv = kv
        o = attend(q, k_all.astype(q.dtype), v_all.astype(q.dtype), mask_BST)
        return jnp.einsum("bsnh,nhd->bsd", o, wo), new_kv


class _GeluMLP(nn.Module):
    """down(gelu_tanh(x @ gate) * (x @ up)): x_BSD -> y_BSD (width I)."""
    features: int
    width: int
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x_BSD):
        D, I, dt = self.features, self.width, self.dtype
        g = x_BSD @ param(self, "gate_proj", (D, I), ("embed", "mlp"), dt)
        u = x_BSD @ param(self, "up_proj", (D, I), ("embed", "mlp"), dt)
        return (jax.nn.gelu(g, approximate=True) * u) @ param(self, "down_proj", (I, D), ("mlp", "embed"), dt)


def route(r_TD, router_params, cfg: "Gemma4Config"):
    """r_TD (raw residual) -> (weights_TX fp32, experts_TX): softmax of proj(norm(r) * scale / sqrt(D)),
    top-k renormalised, times per_expert_scale; router_params = (proj (D, E), scale (D,), per_expert_scale (E,))."""
    proj, scale, pes = router_params
    D = r_TD.shape[-1]
    x = rms_norm(r_TD, None, cfg.rms_norm_eps)
    x = x * scale.astype(x.dtype) * (D ** -0.5)
    probs = jax.nn.softmax((x @ proj).astype(jnp.float32), axis=-1)
    w, idx = jax.lax.top_k(probs, cfg.top_k_experts)
    w = w / jnp.sum(w, axis=-1, keepdims=True)
    return w * jnp.take(pes, idx).astype(jnp.float32), idx


class _Router(nn.Module):
    """The router's params: proj (D, E), scale (D), per_expert_scale (E) (see `route`)."""
    cfg: Gemma4Config
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self):
        c, dt = self.cfg, self.dtype
        D, E = c.hidden_size, c.num_experts
        return (param(self, "proj", (D, E), ("embed", "expert_logits"), dt),
                param(self, "scale", (D,), ("embed",), dt, nn.initializers.ones),
                param(self, "per_expert_scale", (E,), ("expert",), dt, nn.initializers.ones))


def _gelu_experts(x_TD, weights_TX, experts_TX, w_gate_EDF, w_up_EDF, w_down_EFD):
    """Dropless sorted GELU-tanh experts (lax.ragged_dot); expert id E (no local expert) gives 0."""
    E = w_gate_EDF.shape[0]

    def grouped(x_sorted, flat_experts):
        sizes = jnp.bincount(flat_experts, length=E).astype(jnp.int32)
        h = jax.nn.gelu(ragged_matmul(x_sorted, w_gate_EDF, sizes), approximate=True) \
            * ragged_matmul(x_sorted, w_up_EDF, sizes)
        return ragged_matmul(h, w_down_EFD, sizes)
    return _sorted_experts(x_TD, weights_TX, experts_TX, grouped)


class _Experts(nn.Module):
    """Routed GELU-tanh experts, dropless: (x_BSD expert input, r_BSD router input) -> y_BSD; expert
    parallel (models/expert_parallel.py) on a mesh whose "expert" x "model" > 1."""
    cfg: Gemma4Config
    dtype: jnp.dtype = jnp.float32
    mesh: Any = None

    @nn.compact
    def __call__(self, x_BSD, r_BSD, router_params):
        c, dt = self.cfg, self.dtype
        E, D, F = c.num_experts, c.hidden_size, c.moe_intermediate_size
        wg = param(self, "gate_proj", (E, D, F), ("expert", "embed", "mlp"), dt)
        wu = param(self, "up_proj", (E, D, F), ("expert", "embed", "mlp"), dt)
        wd = param(self, "down_proj", (E, F, D), ("expert", "mlp", "embed"), dt)
        x_TD, r_TD = x_BSD.reshape(-1, D), r_BSD.reshape(-1, D)
        m = self.mesh
        if m is None or m.shape["expert"] * m.shape["model"] == 1:
            y = _gelu_experts(x_TD, *route(r_TD, router_params, c), wg, wu, wd)
        else:
            # the router reads r, the experts x: both travel as one (T, 2D) token array
            y = moe_expert_parallel(
                jnp.concatenate([x_TD, r_TD.astype(x_TD.dtype)], axis=-1), router_params, wg, wu, wd, mesh=m,
                token_axes=batch_axes(x_BSD.shape[0], m), route_fn=lambda xr, rp: route(xr[:, D:], rp, c),
                local_experts_fn=lambda xr, w, e, g, u, d: _gelu_experts(xr[:, :D], w, e, g, u, d))
        return y.reshape(x_BSD.shape).astype(x_BSD.dtype)


class Gemma4Diffusion(nn.Module):
    """encode(tokens_BS, cache, token_valid_BS=None) -> cache with the S tokens at slots [cache.length,
    +S); decode(canvas_BC, cache, sc_logits_BCV=None) -> soft-capped fp32 logits (B, C, V) of the canvas
    at [cache.length, +C), self-conditioned on the previous step's logits (None: first step; sc_mask_B
    zeroes rows). `mesh`: a ("data", "expert", "model") Mesh for expert parallelism (None: one device)."""
    cfg: Gemma4Config
    dtype: jnp.dtype = jnp.float32
    mesh: Any = None

    def setup(self):
        c = self.cfg
        self.embed = nn.Embed(c.vocab_size, c.hidden_size, param_dtype=self.dtype, dtype=self.dtype,
                              embedding_init=nn.with_logical_partitioning(nn.initializers.normal(0.02),
                                                                          ("vocab", "embed")))
        self.layers = [Gemma4Layer(c, kind, self.dtype, self.mesh, name=f"layer_{i}")
                       for i, kind in enumerate(c.layer_types)]
        self.final_norm_scale = self.param("final_norm", nn.with_logical_partitioning(nn.initializers.ones, ("embed",)),
                                           (c.hidden_size,), self.dtype)
        self.self_conditioning = _SelfConditioning(c, self.dtype)

    def _embed(self, ids):
        return self.embed(ids) * jnp.asarray(self.cfg.embed_scale, self.dtype).astype(self.dtype)

    def __call__(self, tokens_BS, canvas_BC, cache: EncoderCache, sc_logits_BCV=None):
        """Init / one-shot use: encode then decode."""
        cache = self.encode(tokens_BS, cache)
        return self.decode(canvas_BC, cache, sc_logits_BCV), cache

    def encode(self, tokens_BS, cache: EncoderCache, token_valid_BS=None):
        c = self.cfg
        B, S = tokens_BS.shape
        T = cache.valid.shape[1]
        start = cache.length
        pos_S = start + jnp.arange(S, dtype=jnp.int32)
        positions_BS = jnp.broadcast_to(pos_S, (B, S))
        ok = jnp.ones((B, S), bool) if token_valid_BS is None else token_valid_BS.astype(bool)
        valid = jax.lax.dynamic_update_slice_in_dim(cache.valid, ok, start, axis=1)
        slot_T = jnp.arange(T, dtype=jnp.int32)
        causal_ST = slot_T[None, :] <= pos_S[:, None]
        self_ST = slot_T[None, :] == pos_S[:, None]  # a padded query sees itself (no empty softmax row)
        masks = {FULL: (valid[:, None, :] & causal_ST) | self_ST,
                 SLIDING: (valid[:, None, :] & causal_ST & (slot_T[None, :] > pos_S[:, None] - c.sliding_window))
                 | self_ST}
        x = self._embed(tokens_BS)
        ks, vs = [], []
        for i, layer in enumerate(self.layers):
            x, (k, v) = layer(x, positions_BS, (cache.k[i], cache.v[i]), masks[c.layer_types[i]], True)
            ks.append(k)
            vs.append(v)
        return EncoderCache(k=tuple(ks), v=tuple(vs), valid=valid, length=start + S)

    def decode(self, canvas_BC, cache: EncoderCache, sc_logits_BCV=None, sc_mask_B=None):
        c = self.cfg
        B, C = canvas_BC.shape
        T = cache.valid.shape[1]
        start = cache.length
        positions_BS = jnp.broadcast_to(start + jnp.arange(C, dtype=jnp.int32), (B, C))
        slot_T = jnp.arange(T, dtype=jnp.int32)
        seen = cache.valid & (slot_T < start)[None, :]
        window = c.sliding_window - 1 if c.decoder_window is None else c.decoder_window
        canvas_keys = jnp.ones((B, C), bool)
        masks = {kind: jnp.broadcast_to(jnp.concatenate([m, canvas_keys], axis=1)[:, None, :], (B, C, T + C))
                 for kind, m in ((FULL, seen), (SLIDING, seen & (slot_T >= start - window)[None, :]))}
        emb = self._embed(canvas_BC)
        if sc_logits_BCV is None:
            soft = jnp.zeros_like(emb)
        else:
            probs = jax.nn.softmax(sc_logits_BCV.astype(jnp.float32), axis=-1).astype(self.dtype)
            soft = (probs @ self.embed.embedding) * jnp.asarray(c.embed_scale, self.dtype).astype(emb.dtype)
            if sc_mask_B is not None:  # rows without a previous step: no signal (the reference's mask)
                soft = soft * sc_mask_B.astype(soft.dtype)[:, None, None]
        x = self.self_conditioning(emb, soft)
        for i, layer in enumerate(self.layers):
            x, _ = layer(x, positions_BS, (cache.k[i], cache.v[i]), masks[c.layer_types[i]], False)
        x = rms_norm(x, self.final_norm_scale, c.rms_norm_eps)
        logits = self.embed.attend(x).astype(jnp.float32)
        if c.final_logit_softcapping:
            cap = c.final_logit_softcapping
            logits = jnp.tanh(logits / cap) * cap
        return logits


class _SelfConditioning(nn.Module):
    """post_norm(emb + down(gelu_tanh(gate(pre_norm(soft))) * up(pre_norm(soft)))), post_norm unweighted."""
    cfg: Gemma4Config
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, emb_BCD, soft_BCD):
        c = self.cfg
        normed = _norm(self, "pre_norm", c.hidden_size, self.dtype, soft_BCD, c.rms_norm_eps)
        signal = _GeluMLP(c.hidden_size, c.intermediate_size, self.dtype, name="mlp")(normed)
        return rms_norm(emb_BCD + signal, None, c.rms_norm_eps)


def boxed_params(cfg: Gemma4Config, seed: int = 0, dtype=jnp.float32, batch: int = 1, slots: int = 8):
    """Random params, each boxed with its logical axes (nn.get_partition_spec reads them)."""
    m = Gemma4Diffusion(cfg, dtype)
    cache = EncoderCache.empty(cfg, batch, slots, dtype)
    ids = jnp.zeros((batch, 2), jnp.int32)
    return m.init(jax.random.PRNGKey(seed), ids, ids, cache, jnp.zeros((batch, 2, cfg.vocab_size), dtype))["params"]


def init_params(cfg: Gemma4Config, seed: int = 0, dtype=jnp.float32, batch: int = 1, slots: int = 8):
    """Random params (tests); shapes only depend on cfg."""
    return nn.meta.unbox(boxed_params(cfg, seed, dtype, batch, slots))
