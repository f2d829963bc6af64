"""Weight-only quantization: a `QuantizedWeight` pytree and the one matmul the layers use.

A weight (lead..., in..., out...) is stored as q (int8 / float8_e4m3fn) and an fp32 scale; `matmul(x, w)`:
x (..., in...) -> (..., out...). Layout, rounding, the tiled dequant: docs/internals/quantization.md.
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

KINDS = ("int8", "fp8")
BLOCK = 128  # fp8 block edge
FP8_MAX = 448.0  # largest finite float8_e4m3fn
INT8_MAX = 127.0
DEQUANT_TILE_ELEMS = 1 << 20  # at most this many dequantized weight elements per tile (4 MiB fp32)


def check_kind(kind) -> str:
    if kind not in KINDS:
        raise ValueError(f"unknown --quantize {kind!r}; choose int8 or fp8")
    return kind


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedWeight:
    """q (lead..., in..., out...) int8 | float8_e4m3fn and its fp32 scale (docs/internals/quantization.md)."""
    q: jax.Array
    scale: jax.Array
    kind: str = dataclasses.field(metadata=dict(static=True))
    n_in: int = dataclasses.field(metadata=dict(static=True))
    n_out: int = dataclasses.field(metadata=dict(static=True))
    out_first: bool = dataclasses.field(default=False, metadata=dict(static=True))

    @property
    def shape(self):
        return self.q.shape

    @property
    def ndim(self):
        return len(self.q.shape)

    @property
    def n_lead(self) -> int:
        return self.ndim - self.n_in - self.n_out

    def __getitem__(self, idx):
        """Index lead dims only (a layer, an expert): w[l, e] -> QuantizedWeight of that slice."""
        n = len(idx) if isinstance(idx, tuple) else 1
        if n > self.n_lead:
            raise IndexError(f"QuantizedWeight: can only index its {self.n_lead} lead dims, got {n} indices")
        return QuantizedWeight(self.q[idx], self.scale[idx], self.kind, self.n_in, self.n_out, self.out_first)

    def __rmatmul__(self, x):
        """x @ w for a weight with one in dim (the MLP and expert tiles use `@`)."""
        return matmul(x, self)


def _check_out_first(n_in: int, n_out: int):
    if (n_in, n_out) != (1, 1):
        raise ValueError(f"an out-first (lead..., out, in) weight has one in and one out dim, got n_in={n_in}, "
                         f"n_out={n_out}")


def _swap_last2(t: tuple) -> tuple:
    return tuple(t[:-2]) + (t[-1], t[-2])


def scale_shape(shape, kind: str, n_in: int, n_out: int, out_first: bool = False) -> tuple:
    """The fp32 scale's shape for a weight of `shape`: int8 in dims -> 1; fp8 (lead..., K/128, N/128) rounded up."""
    if out_first:
        _check_out_first(n_in, n_out)
        return _swap_last2(scale_shape(_swap_last2(tuple(shape)), kind, 1, 1))
    lead = len(shape) - n_in - n_out
    if kind == "int8":
        return tuple(shape[:lead]) + (1,) * n_in + tuple(shape[lead + n_in:])
    K, N = math.prod(shape[lead:lead + n_in]), math.prod(shape[lead + n_in:])
    return tuple(shape[:lead]) + (-(-K // BLOCK), -(-N // BLOCK))


def scale_axes(axes: tuple, kind: str, n_in: int, n_out: int, out_first: bool = False) -> tuple:
    """Logical axes of the scale leaf from the weight's (int8: lead and out axes; fp8: lead axes, block
    dims named after the first in and out axis)."""
    if out_first:
        _check_out_first(n_in, n_out)
        return _swap_last2(scale_axes(_swap_last2(tuple(axes)), kind, 1, 1))
    lead = len(axes) - n_in - n_out
    if kind == "int8":
        return tuple(axes[:lead]) + (None,) * n_in + tuple(axes[lead + n_in:])
    return tuple(axes[:lead]) + (axes[lead], axes[lead + n_in])


def quantize(w, kind: str, n_in: int = 1, n_out: int = 1, out_first: bool = False) -> QuantizedWeight:
    """A float weight (numpy or jax) -> QuantizedWeight with numpy leaves, computed in fp32 on the host."""
    check_kind(kind)
    w = np.asarray(w, dtype=np.float32)
    if out_first:
        _check_out_first(n_in, n_out)
        if w.ndim < 2:
            raise ValueError(f"quantize: an out-first weight needs 2 dims, got shape {w.shape}")
        t = quantize(np.swapaxes(w, -1, -2), kind)
        return QuantizedWeight(np.ascontiguousarray(np.swapaxes(t.q, -1, -2)),
                               np.ascontiguousarray(np.swapaxes(t.scale, -1, -2)), kind, 1, 1, True)
    if n_in < 1 or n_out < 1 or w.ndim < n_in + n_out:
        raise ValueError(f"quantize: weight of shape {w.shape} cannot have n_in={n_in}, n_out={n_out}")
    lead = w.ndim - n_in - n_out
    if kind == "int8":
        axes = tuple(range(lead, lead + n_in))
        amax = np.max(np.abs(w), axis=axes, keepdims=True)
        scale = np.where(amax > 0, amax / np.float32(INT8_MAX), np.float32(1)).astype(np.float32)
        q = np.clip(np.rint(w / scale), -INT8_MAX, INT8_MAX).astype(np.int8)
        return QuantizedWeight(q, scale, kind, n_in, n_out)
    K, N = math.prod(w.shape[lead:lead + n_in]), math.prod(w.shape[lead + n_in:])
    kb, nb = -(-K // BLOCK), -(-N // BLOCK)
    w2 = w.reshape(w.shape[:lead] + (K, N))
    pad = [(0, 0)] * lead + [(0, kb * BLOCK - K), (0, nb * BLOCK - N)]
    blocks = np.pad(w2, pad).reshape(w.shape[:lead] + (kb, BLOCK, nb, BLOCK))
    amax = np.max(np.abs(blocks), axis=(-3, -1))
    scale = np.where(amax > 0, amax / np.float32(FP8_MAX), np.float32(1)).astype(np.float32)
    full = _expand_np(scale, K, N)
    q = (w2 / full).astype(jnp.float8_e4m3fn).reshape(w.shape)
    return QuantizedWeight(q, scale, kind, n_in, n_out)


def _expand_np(scale, K, N):
    return np.repeat(np.repeat(scale, BLOCK, axis=-2), BLOCK, axis=-1)[..., :K, :N]


def dequantize(w: QuantizedWeight, dtype=jnp.float32):
    """The whole weight in `dtype` (tests and references; the layers never call this)."""
    if w.out_first:
        t = QuantizedWeight(jnp.swapaxes(w.q, -1, -2), jnp.swapaxes(w.scale, -1, -2), w.kind, 1, 1)
        return jnp.swapaxes(dequantize(t, dtype), -1, -2)
    lead = w.ndim - w.n_in - w.n_out
    if w.kind == "int8":
        return (w.q.astype(jnp.float32) * w.scale).astype(dtype)
    K, N = math.prod(w.shape[lead:lead + w.n_in]), math.prod(w.shape[lead + w.n_in:])
    s = jnp.repeat(jnp.repeat(w.scale, BLOCK, axis=-2), BLOCK, axis=-1)[..., :K, :N]
    return (w.q.astype(jnp.float32).reshape(w.shape[:lead] + (K, N)) * s).reshape(w.shape).astype(dtype)


def _column_tile(K: int, N: int, multiple: int) -> int:
    """Columns per dequantized tile: N when K*N fits DEQUANT_TILE_ELEMS, else the largest fitting divisor
    of N that is a multiple of `multiple` (N when none)."""
    if K * N <= DEQUANT_TILE_ELEMS:
        return N
    best = N
    for t in range(multiple, N, multiple):
        if N % t == 0 and K * t <= DEQUANT_TILE_ELEMS:
            best = t
    return best


def _dequant_tile(q_KN, scale, start, tn, K, dtype, kind):
    """Columns [start, start + tn) of the (K, N) weight, dequantized to `dtype` (int8: unscaled)."""
    q_t = jax.lax.dynamic_slice_in_dim(q_KN, start, tn, axis=1)
    if q_t.dtype == jnp.uint8:  # fp8 carried as its bits (see matmul)
        q_t = jax.lax.bitcast_convert_type(q_t, jnp.float8_e4m3fn)
    if kind == "int8":
        return q_t.astype(dtype)
    s_t = jax.lax.dynamic_slice_in_dim(scale, start // BLOCK, -(-tn // BLOCK), axis=1)
    if K % BLOCK == 0 and tn % BLOCK == 0:  # broadcast the block scales, no expanded copy
        w = q_t.astype(jnp.float32).reshape(K // BLOCK, BLOCK, tn // BLOCK, BLOCK) * s_t[:, None, :, None]
        return w.reshape(K, tn).astype(dtype)
    s_full = jnp.repeat(jnp.repeat(s_t, BLOCK, axis=0)[:K], BLOCK, axis=1)[:, :tn]
    return (q_t.astype(jnp.float32) * s_full).astype(dtype)


def _output_tiles(tile, M: int, N: int, tn: int, dtype):
    """y (M, N) from tile(start, n) -> (M, n) output columns: one call, or a fori_loop over N // tn tiles."""
    if tn == N:
        return tile(0, N)

    def body(j, y):
        return jax.lax.dynamic_update_slice_in_dim(y, tile(j * tn, tn), j * tn, axis=1)
    return jax.lax.fori_loop(0, N // tn, body, jnp.zeros((M, N), dtype))


def matmul(x, w, precision=None):
    """x (..., in...) contracted with w's in dims -> (..., out...) in x's dtype. w: a plain array (one
    in dim) or a QuantizedWeight without lead dims (dequantized tile by tile)."""
    if not isinstance(w, QuantizedWeight):
        return jnp.matmul(x, w, precision=precision)
    if w.n_lead:
        raise ValueError(f"matmul: index the {w.n_lead} lead dims of a {w.shape} QuantizedWeight first")
    if w.out_first:
        return _matmul_out_first(x, w, precision)
    in_shape, out_shape = w.shape[:w.n_in], w.shape[w.n_in:]
    if tuple(x.shape[x.ndim - w.n_in:]) != tuple(in_shape):
        raise ValueError(f"matmul: x {x.shape} does not end with the weight's in dims {in_shape}")
    K, N = math.prod(in_shape), math.prod(out_shape)
    x_MK = x.reshape(-1, K)
    q_KN = w.q.reshape(K, N)
    if w.kind == "fp8":  # carried as uint8 bits: XLA:CPU would otherwise convert the whole fp8 array
        q_KN = jax.lax.bitcast_convert_type(q_KN, jnp.uint8)  # to f16 up front (its fp8 normalization)
    scale = w.scale.reshape(1, N) if w.kind == "int8" else w.scale
    tn = _column_tile(K, N, BLOCK if w.kind == "fp8" else 1)
    dt = x.dtype

    def tile(start, n):
        y = jnp.matmul(x_MK, _dequant_tile(q_KN, scale, start, n, K, dt, w.kind), precision=precision)
        if w.kind == "int8":
            y = (y * jax.lax.dynamic_slice_in_dim(scale, start, n, axis=1)).astype(dt)
        return y

    y_MN = _output_tiles(tile, x_MK.shape[0], N, tn, dt)
    return y_MN.reshape(x.shape[:x.ndim - w.n_in] + tuple(out_shape))


def _matmul_out_first(x, w: QuantizedWeight, precision=None):
    """x (..., K) with an out-first (N, K) QuantizedWeight -> (..., N), one tile of rows at a time."""
    N, K = w.shape
    if x.shape[-1] != K:
        raise ValueError(f"matmul: x {x.shape} does not end with the out-first weight's in dim {K}")
    x_MK = x.reshape(-1, K)
    q_NK = w.q if w.kind == "int8" else jax.lax.bitcast_convert_type(w.q, jnp.uint8)  # as in matmul
    tn = _column_tile(K, N, BLOCK if w.kind == "fp8" else 1)
    dt = x.dtype

    def tile(start, n):
        q_t = jax.lax.dynamic_slice_in_dim(q_NK, start, n, axis=0)
        if w.kind == "int8":
            s_t = jax.lax.dynamic_slice_in_dim(w.scale, start, n, axis=0)  # (n, 1)
            y = jnp.matmul(x_MK, q_t.astype(dt).T, precision=precision)
            return (y * s_t[:, 0]).astype(dt)
        q_t = jax.lax.bitcast_convert_type(q_t, jnp.float8_e4m3fn).astype(jnp.float32)
        s_t = jax.lax.dynamic_slice_in_dim(w.scale, start // BLOCK, -(-n // BLOCK), axis=0)  # (n/128, K/128)
        s_full = jnp.repeat(jnp.repeat(s_t, BLOCK, axis=0)[:n], BLOCK, axis=1)[:, :K]
        return jnp.matmul(x_MK, (q_t * s_full).astype(dt).T, precision=precision)

    y_MN = _output_tiles(tile, x_MK.shape[0], N, tn, dt)
    return y_MN.reshape(x.shape[:-1] + (N,))


def einsum(spec: str, x, w):
    """jnp.einsum(spec, x, w) for a plain w; `matmul(x, w)` for a QuantizedWeight. spec must
    contract x's trailing dims with w's leading dims in order (e.g. "bsnh,nhd->bsd"), or, for an
    out-first weight, x's last dim with w's last (e.g. "bsd,vd->bsv")."""
    if isinstance(w, QuantizedWeight):
        return matmul(x, w)
    return jnp.einsum(spec, x, w)


# Params that get quantized: path suffix -> (n_in, n_out). Layer stacks and experts are lead dims.
# The router (fp32 routing), norms, biases and the embedding table stay in the model dtype.
QUANTIZED_PARAMS = {
    "attn/q_proj": (1, 2), "attn/k_proj": (1, 2), "attn/v_proj": (1, 2), "attn/o_proj": (2, 1),
    "mlp/gate_proj": (1, 1), "mlp/up_proj": (1, 1), "mlp/down_proj": (1, 1),
    "shared/gate_proj": (1, 1), "shared/up_proj": (1, 1), "shared/down_proj": (1, 1),
    "lm_head/unembedding": (1, 1),
}
OUT_FIRST_PARAMS = ("lm_head/unembedding",)  # stored (out, in): the (V, D) LM head
SCALE_SUFFIX = "@scale"  # flat path of a quantized param's scale leaf: "<path>@scale"


def quant_dims(path: str):
    """(n_in, n_out) if the '/'-joined param path is quantized, else None."""
    for suffix, dims in QUANTIZED_PARAMS.items():
        if path == suffix or path.endswith("/" + suffix):
            return dims
    return None


def is_out_first(path: str) -> bool:
    """Whether the '/'-joined param path is stored (out, in) (OUT_FIRST_PARAMS)."""
    return any(path == s or path.endswith("/" + s) for s in OUT_FIRST_PARAMS)


def quantize_flat(flat: dict, kind: str) -> tuple[dict, dict]:
    """Flat {path: float array} -> (flat {path: q, path@scale: scale, other paths unchanged},
    {path: {"kind", "n_in", "n_out"[, "out_first"]}} metadata for the quantized ones)."""
    check_kind(kind)
    out, meta = {}, {}
    for path, arr in flat.items():
        dims = quant_dims(path)
        if dims is None:
            out[path] = arr
            continue
        qw = quantize(arr, kind, *dims, out_first=is_out_first(path))
        out[path], out[path + SCALE_SUFFIX] = qw.q, qw.scale
        meta[path] = metadata(qw)
    return out, meta


def metadata(w: QuantizedWeight) -> dict:
    """A quantized param's manifest entry: {"kind", "n_in", "n_out"}, plus "out_first": true
    for an out-first weight (absent means in-first)."""
    return {"kind": w.kind, "n_in": w.n_in, "n_out": w.n_out, **({"out_first": True} if w.out_first else {})}


def pack_flat(flat: dict, meta: dict) -> dict:
    """Inverse of the split in quantize_flat: {path: q, path@scale: s} -> {path: QuantizedWeight}."""
    out = {k: v for k, v in flat.items() if not k.endswith(SCALE_SUFFIX)}
    for path, m in (meta or {}).items():
        if path not in flat or path + SCALE_SUFFIX not in flat:
            raise ValueError(f"quantized param {path!r}: its values or {SCALE_SUFFIX} leaf is missing")
        out[path] = QuantizedWeight(flat[path], flat[path + SCALE_SUFFIX], check_kind(m["kind"]),
                                    int(m["n_in"]), int(m["n_out"]), bool(m.get("out_first", False)))
    return out


def unpack_flat(flat: dict) -> tuple[dict, dict]:
    """{path: QuantizedWeight | array} -> (flat leaves with path@scale, metadata) (for saving)."""
    out, meta = {}, {}
    for path, v in flat.items():
        if isinstance(v, QuantizedWeight):
            out[path], out[path + SCALE_SUFFIX] = v.q, v.scale
            meta[path] = metadata(v)
        else:
            out[path] = v
    return out, meta


def quantize_abstract(flat: dict, kind: str) -> dict:
    """Flat {path: ShapeDtypeStruct} -> the same with the quantized params as QuantizedWeight of
    ShapeDtypeStructs (AOT export of a quantized model without weights)."""
    check_kind(kind)
    qdt = jnp.int8 if kind == "int8" else jnp.float8_e4m3fn
    out = {}
    for path, a in flat.items():
        dims = quant_dims(path)
        of = is_out_first(path)
        out[path] = a if dims is None else QuantizedWeight(
            jax.ShapeDtypeStruct(a.shape, qdt, sharding=getattr(a, "sharding", None)),
            jax.ShapeDtypeStruct(scale_shape(a.shape, kind, *dims, out_first=of), jnp.float32), kind, *dims, of)
    return out


def spec_like(w, spec):
    """The shard_map in_spec of a weight whose unquantized spec is `spec`: `spec` for an array; for a
    QuantizedWeight, `spec` for q and a scale_axes-style spec for the scale."""
    if not isinstance(w, QuantizedWeight):
        return spec
    from jax.sharding import PartitionSpec as P
    parts = tuple(spec) + (None,) * (w.ndim - len(spec))
    return QuantizedWeight(spec, P(*scale_axes(parts, w.kind, w.n_in, w.n_out, w.out_first)), w.kind, w.n_in,
                           w.n_out, w.out_first)


def expert_matmul(x_TD, w_EDF):
    """All-experts reference einsum "td,edf->tef" for a plain or quantized stack (experts_dense)."""
    if not isinstance(w_EDF, QuantizedWeight):
        return jnp.einsum("td,edf->tef", x_TD, w_EDF)
    return jax.vmap(lambda w: matmul(x_TD, w), out_axes=1)(w_EDF)


def ragged_matmul(x_RD, w_EDF, group_sizes_E):
    """lax.ragged_dot for a plain or quantized expert stack (int8: scaled after the dot, exact; fp8: the
    stack dequantized first, docs/internals/quantization.md)."""
    if not isinstance(w_EDF, QuantizedWeight):
        return jax.lax.ragged_dot(x_RD, w_EDF, group_sizes_E)
    if w_EDF.kind == "int8":
        E = w_EDF.shape[0]
        row_group = jnp.searchsorted(jnp.cumsum(group_sizes_E), jnp.arange(x_RD.shape[0]), side="right")
        s_RF = jnp.take(w_EDF.scale[:, 0, :], jnp.minimum(row_group, E - 1), axis=0)
        y = jax.lax.ragged_dot(x_RD, w_EDF.q.astype(x_RD.dtype), group_sizes_E)
        return (y * s_RF).astype(x_RD.dtype)
    return jax.lax.ragged_dot(x_RD, dequantize(w_EDF, x_RD.dtype), group_sizes_E)


def is_quantized(tree) -> bool:
    return any(isinstance(v, QuantizedWeight) for v in jax.tree_util.tree_leaves(
        tree, is_leaf=lambda v: isinstance(v, QuantizedWeight)))
