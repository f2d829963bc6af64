"""The layer loop over layer-stacked params, and matmuls that read a layer's weight from the stack.

`scan_layers` hands each layer its matmul weights as `LayerSlice(stack, layer)`, read in column tiles
on one CPU device, else w[layer]. Why and measurements: docs/internals/model_code.md.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp

from dinfer_jax import kernels
from dinfer_jax.models import quant

# At most this many weight elements per in-place column tile (1 MiB of fp32: an L2-sized piece).
TILE_ELEMS = 1 << 18
# Column tiles only for matmuls of at most this many rows (window forwards): with more rows the GEMM
# amortises one copy of the matrix, and narrow tiles made the 7B-A1B full refresh (192 rows) ~7%
# slower on the project's 2-core box (bench/RESULTS.md, issue 19 item 2).
TILE_MAX_ROWS = 64


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LayerSlice:
    """Layer `layer` of a layer-stacked weight (a plain array or a quant.QuantizedWeight), not yet
    sliced. `in_place`: matmuls read it from the stack in column tiles (else they slice it first)."""
    stack: Any
    layer: jax.Array
    in_place: bool = dataclasses.field(metadata=dict(static=True))

    @property
    def shape(self):
        return tuple(self.stack.shape[1:])

    @property
    def ndim(self):
        return len(self.shape)

    @property
    def dtype(self):
        return self.stack.dtype if not isinstance(self.stack, quant.QuantizedWeight) else self.stack.q.dtype

    def get(self):
        """The slice itself (a copy on XLA:CPU)."""
        return index(self.stack, self.layer)

    def __rmatmul__(self, x):
        return matmul(x, self)


def index(stack, i):
    """stack[i] along the leading axis, for an array or a QuantizedWeight (all its leaves)."""
    return jax.tree_util.tree_map(lambda a: jax.lax.dynamic_index_in_dim(a, i, keepdims=False), stack)


def resolve(w):
    """A LayerSlice's slice; anything else unchanged."""
    return w.get() if isinstance(w, LayerSlice) else w


def _column_tile(K: int, N: int) -> int:
    """Columns per in-place tile (a divisor of N, multiple of 128, K * tile <= TILE_ELEMS when one
    exists); 0: slice the matrix whole."""
    if K * N <= TILE_ELEMS:
        return 0
    divisors = [t for t in range(128, N, 128) if N % t == 0]
    fitting = [t for t in divisors if K * t <= TILE_ELEMS]
    return max(fitting) if fitting else min(divisors, default=0)


def matmul_in_place(x_MK, stack, idx: tuple, K: int, N: int):
    """x_MK @ stack[idx] ((K, N) after the leading indices) in column tiles, one dot each (for at most
    TILE_MAX_ROWS rows; else one slice, one dot)."""
    lead = len(idx)
    w = stack.reshape(stack.shape[:lead] + (K, N))
    tn = _column_tile(K, N)
    if not tn or x_MK.shape[0] > TILE_MAX_ROWS:
        return x_MK @ w[idx]
    starts = tuple(jnp.asarray(i, jnp.int32) for i in idx)
    zero = jnp.zeros((), jnp.int32)

    def body(j, y):
        tile = jax.lax.dynamic_slice(w, starts + (zero, j * tn), (1,) * lead + (K, tn)).reshape(K, tn)
        return jax.lax.dynamic_update_slice_in_dim(y, x_MK @ tile, j * tn, axis=1)
    return jax.lax.fori_loop(0, N // tn, body, jnp.zeros((x_MK.shape[0], N), x_MK.dtype))


def matmul(x, w, n_in: int = 1):
    """x (..., in...) contracted with w's first n_in dims -> (..., out...), for a plain array, a
    QuantizedWeight (quant.matmul) or a LayerSlice of either."""
    if not isinstance(w, LayerSlice):
        if isinstance(w, quant.QuantizedWeight):
            return quant.matmul(x, w)
        K = math.prod(w.shape[:n_in])
        return (x.reshape(x.shape[:x.ndim - n_in] + (K,)) @ w.reshape(K, -1)).reshape(
            x.shape[:x.ndim - n_in] + tuple(w.shape[n_in:]))
    if not w.in_place or isinstance(w.stack, quant.QuantizedWeight):
        return matmul(x, w.get(), n_in)
    in_shape, out_shape = w.shape[:n_in], w.shape[n_in:]
    K, N = math.prod(in_shape), math.prod(out_shape)
    y = matmul_in_place(x.reshape(-1, K), w.stack, (w.layer,), K, N)
    return y.reshape(x.shape[:x.ndim - n_in] + tuple(out_shape))


def einsum(spec: str, x, w):
    """quant.einsum for a LayerSlice too: spec must contract x's trailing dims with w's leading
    dims in order (e.g. "bsnh,nhd->bsd")."""
    if not isinstance(w, LayerSlice):
        return quant.einsum(spec, x, w)
    if not w.in_place or isinstance(w.stack, quant.QuantizedWeight):
        return quant.einsum(spec, x, w.get())
    ins, _ = spec.split("->")
    xs, ws = ins.split(",")
    n_in = len([c for c in ws if c in xs])
    return matmul(x, w, n_in)


def expert_matmul(rows, w, e):
    """rows @ w[e] for an expert stack w (E, D, F): a plain array, a QuantizedWeight, or a LayerSlice
    (w[layer, e] read straight from the stack, never the layer's whole stack)."""
    if isinstance(w, LayerSlice):
        return rows @ w.stack[w.layer, e]
    return rows @ w[e]


def reads_in_place(platform: str | None, mesh) -> bool:
    """Whether layer weights are read from the stack in place: one CPU device (the compile
    target, None = jax.default_backend())."""
    return kernels.reads_layers_in_place(platform, mesh)


def _is_matmul_weight(path) -> bool:
    keys = "/".join(str(getattr(k, "key", k)) for k in path)
    return quant.quant_dims(keys) is not None


def scan_layers(fn, stacked_params: dict, carry, xs, platform: str | None = None, mesh=None,
                update: tuple | None = None):
    """lax.scan over the layer stack: (carry, ys_i) = fn(params_i, carry, xs_i), params_i's matmul
    weights as LayerSlices. Returns (carry, ys stacked over layers).

    update = (offset, rows): layer i reads xs[offset + i] (rows `rows`, (R,) distinct, when given) and
    ys_i is written back there in place; returns (carry, the updated xs)."""
    in_place = reads_in_place(platform, mesh)
    n = jax.tree_util.tree_leaves(stacked_params)[0].shape[0]

    def body(c, inp):
        i, x_i = inp
        p_i = jax.tree_util.tree_map_with_path(
            lambda path, w: LayerSlice(w, i, in_place) if _is_matmul_weight(path) else index(w, i),
            stacked_params, is_leaf=lambda v: isinstance(v, quant.QuantizedWeight))
        return fn(p_i, c, x_i)
    if update is None:
        return jax.lax.scan(body, carry, (jnp.arange(n), xs))
    offset, rows = update

    def read(a, j):
        layer = jax.lax.dynamic_index_in_dim(a, j, 0, keepdims=False)
        return layer if rows is None else jnp.take(layer, rows, axis=0)

    def write(a, y, j):  # in the scan's carry: XLA updates the stack in place
        y = y.astype(a.dtype)
        if rows is None:
            return jax.lax.dynamic_update_index_in_dim(a, y, j, 0)
        return a.at[j, rows].set(y, unique_indices=True)  # rows: distinct (the caller's contract)

    def body_in_place(c, i):
        c0, st = c
        j = i + offset
        c1, y = body(c0, (i, jax.tree_util.tree_map(lambda a: read(a, j), st)))
        return (c1, jax.tree_util.tree_map(lambda a, y_: write(a, y_, j), st, y)), None
    (carry, xs), _ = jax.lax.scan(body_in_place, (carry, xs), jnp.arange(n))
    return carry, xs
