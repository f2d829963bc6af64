"""Megablox-style grouped matmul (GMM) in Pallas for TPU (Mosaic); interpreter elsewhere.

    out_MN[m] = lhs_MK[m] @ rhs_GKN[g(m)]

M rows sorted by group, K contraction, N output, G groups (experts), V grid visits along M; rows past
sum(group_sizes) come out as 0. Design, block-size rules, quantized rhs: docs/internals/kernels.md.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

_SUPPORTED_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
_QUANT_DTYPES = {jnp.dtype(jnp.int8): "int8", jnp.dtype(jnp.float8_e4m3fn): "fp8"}
_LANES = 128
_FP8_BLOCK = 128  # fp8 scale block edge (quant.BLOCK)


@dataclasses.dataclass(frozen=True)
class GmmBlockSizes:
    """Tile sizes: block_m rows of lhs, block_k of the contraction, block_n output columns (TPU rules:
    `validate`, docs/internals/kernels.md)."""
    block_m: int = 128
    block_k: int = 128
    block_n: int = 128

    def validate(self):
        for name in ("block_m", "block_k", "block_n"):
            v = getattr(self, name)
            if not isinstance(v, int) or v <= 0:
                raise ValueError(f"GmmBlockSizes.{name}={v!r} must be a positive int")


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def _sublanes(dtype) -> int:
    """Rows per (sublane x 128 lane) native TPU tile: 8 for 32-bit, 16 for 16-bit dtypes."""
    return 8 * max(1, 4 // jnp.dtype(dtype).itemsize)


def _fit(block: int, dim: int, what: str, letter: str) -> int:
    """A block no larger than its dim, dividing it, lane-aligned unless it is the whole dim."""
    b = min(block, dim)
    if dim % b:
        raise ValueError(f"gmm: block_{letter}={b} does not divide {what}={dim}; pick a block that "
                         f"divides it (or >= {dim} for a single block)")
    if b != dim and b % _LANES:
        raise ValueError(f"gmm: block_{letter}={b} must be a multiple of {_LANES} (TPU lane width) "
                         f"or the whole {what}={dim}")
    return b


def default_block_sizes(K: int, N: int) -> GmmBlockSizes:
    """GmmBlockSizes() fitted to K and N: a 128 block where it divides the dim, else the whole dim."""
    fit = lambda d: _LANES if d % _LANES == 0 else d  # noqa: E731
    return GmmBlockSizes(block_k=fit(K), block_n=fit(N))


def validate(lhs_MK, rhs_GKN, group_sizes_G, block_sizes: GmmBlockSizes | None, out_dtype, rhs_scale=None):
    """Clear errors for inputs the kernel does not support. Returns the effective (tm, tk, tn)
    (block_sizes None: `default_block_sizes`; given ones are checked as they are)."""
    if lhs_MK.ndim != 2:
        raise ValueError(f"gmm: lhs must be 2-D (M, K), got shape {tuple(lhs_MK.shape)}")
    if rhs_GKN.ndim != 3:
        raise ValueError(f"gmm: rhs must be 3-D (G, K, N), got shape {tuple(rhs_GKN.shape)}")
    if group_sizes_G.ndim != 1:
        raise ValueError(f"gmm: group_sizes must be 1-D (G,), got shape {tuple(group_sizes_G.shape)}")
    (M, K), (G, Kr, N) = lhs_MK.shape, rhs_GKN.shape
    if Kr != K:
        raise ValueError(f"gmm: contraction dims differ: lhs (M, K)={tuple(lhs_MK.shape)} vs "
                         f"rhs (G, K, N)={tuple(rhs_GKN.shape)}")
    if group_sizes_G.shape[0] != G:
        raise ValueError(f"gmm: group_sizes has {group_sizes_G.shape[0]} entries but rhs has G={G} groups")
    if G == 0 or K == 0 or N == 0:
        raise ValueError(f"gmm: empty dims are not supported: G={G}, K={K}, N={N}")
    if not jnp.issubdtype(group_sizes_G.dtype, jnp.integer):
        raise ValueError(f"gmm: group_sizes must be an integer array, got {group_sizes_G.dtype}")
    quant = _QUANT_DTYPES.get(jnp.dtype(rhs_GKN.dtype))
    checked = (("lhs", lhs_MK.dtype), ("preferred_element_type", out_dtype)) + (() if quant else (("rhs", rhs_GKN.dtype),))
    for name, dt in checked:
        if jnp.dtype(dt) not in _SUPPORTED_DTYPES:
            raise ValueError(f"gmm: {name} dtype {jnp.dtype(dt)} is not supported "
                             f"(supported: {[str(d) for d in _SUPPORTED_DTYPES]})")
    if rhs_scale is not None:
        if quant is None:
            raise ValueError(f"gmm: rhs_scale is given, so rhs must be int8 or float8_e4m3fn, got {rhs_GKN.dtype}")
        want = (G, 1, N) if quant == "int8" else (G, -(-K // _FP8_BLOCK), -(-N // _FP8_BLOCK))
        if tuple(rhs_scale.shape) != want or rhs_scale.dtype != jnp.float32:
            raise ValueError(f"gmm: {quant} rhs of shape {(G, K, N)} needs an fp32 rhs_scale of shape {want}, got "
                             f"{rhs_scale.dtype}{tuple(rhs_scale.shape)}")
    elif quant:
        raise ValueError(f"gmm: a quantized {rhs_GKN.dtype} rhs needs its rhs_scale")
    elif lhs_MK.dtype != rhs_GKN.dtype:
        raise ValueError(f"gmm: lhs and rhs dtypes differ ({lhs_MK.dtype} vs {rhs_GKN.dtype}); cast one")
    block_sizes = default_block_sizes(K, N) if block_sizes is None else block_sizes
    block_sizes.validate()
    sub = max(_sublanes(lhs_MK.dtype), _sublanes(out_dtype))
    if block_sizes.block_m % sub:
        raise ValueError(f"gmm: block_m={block_sizes.block_m} must be a multiple of {sub} "
                         f"(TPU sublane tiling for {jnp.dtype(lhs_MK.dtype)} in / {jnp.dtype(out_dtype)} out)")
    tm = min(block_sizes.block_m, _round_up(max(M, 1), sub))
    tk = _fit(block_sizes.block_k, K, "K", "k")
    tn = _fit(block_sizes.block_n, N, "N", "n")
    return tm, tk, tn


def make_group_metadata(group_sizes_G, num_rows: int, tm: int):
    """Visit schedule for rows padded to tiles_m = ceil(num_rows / tm) row tiles -> (group_offsets
    (G+1,), group_ids_V, tile_ids_V, num_visits (1,)), int32, V = tiles_m + G - 1 (static). Visits:
    every row tile of each non-empty group in order, then one zero-writing visit per row tile past
    sum(group_sizes); visits past num_visits repeat the last real one.
    """
    G = group_sizes_G.shape[0]
    tiles_m = -(-num_rows // tm)
    V = tiles_m + G - 1
    sizes = jnp.maximum(group_sizes_G.astype(jnp.int32), 0)
    ends = jnp.minimum(jnp.cumsum(sizes), num_rows)  # cut at M: rows past M do not exist
    starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]])
    group_offsets = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends])
    first_tile = starts // tm
    tiles_per_group = jnp.where(ends > starts, (ends - 1) // tm - first_tile + 1, 0)
    visit_end = jnp.cumsum(tiles_per_group)  # exclusive end of each group's visits
    visit_start = visit_end - tiles_per_group
    group_visits = visit_end[-1]
    used_tiles = (ends[-1] + tm - 1) // tm  # tiles holding at least one grouped row
    num_visits = group_visits + (tiles_m - used_tiles)

    v = jnp.arange(V, dtype=jnp.int32)
    g = jnp.minimum(jnp.searchsorted(visit_end, v, side="right").astype(jnp.int32), G - 1)
    in_groups = v < group_visits
    tile = jnp.where(in_groups, first_tile[g] + v - visit_start[g], used_tiles + v - group_visits)
    g = jnp.where(in_groups, g, G - 1)
    last = num_visits - 1
    real = v < num_visits
    tile_ids = jnp.where(real, tile, tile[last]).astype(jnp.int32)
    group_ids = jnp.where(real, g, g[last]).astype(jnp.int32)
    return group_offsets, group_ids, tile_ids, num_visits.reshape(1).astype(jnp.int32)


def _decode_e4m3(bits):
    """float8_e4m3fn bits (any int dtype, low 8 bits) -> fp32 with int32 ops only (no fp8 in Mosaic
    before TPU v7). Exact for finite values; the NaN patterns (0x7f, 0xff) give +-480."""
    b = bits.astype(jnp.int32) & 0xFF
    mag = b & 0x7F
    # normal: exponent e - 7 + 127 = e + 120 in f32's exponent field, the 3 mantissa bits on top
    normal = jax.lax.bitcast_convert_type((mag << 20) + (120 << 23), jnp.float32)
    subnormal = (b & 7).astype(jnp.float32) * (2.0 ** -9)  # exponent field 0: m/8 * 2^-6
    val = jnp.where(mag < 8, subnormal, normal)
    return jnp.where(b >= 0x80, -val, val)


def _gmm_kernel(group_offsets, group_ids, tile_ids, num_visits,  # scalar prefetch (SMEM)
                lhs_ref, rhs_ref, *refs, tm: int, tn: int, nk: int, quant: str | None = None):
    # refs = ([scale_ref,] [poisoned_init_ref,] out_ref, acc_ref[, deq_ref]): scale_ref with a
    # quantized rhs (docs/internals/kernels.md); deq_ref, fp8 only, holds the dequantized (tk, tn) rhs tile.
    if quant == "fp8":
        scale_ref, out_ref, acc_ref, deq_ref = refs[0], refs[-3], refs[-2], refs[-1]
    else:
        scale_ref, out_ref, acc_ref = (refs[0] if quant else None), refs[-2], refs[-1]
    v, k = pl.program_id(1), pl.program_id(2)
    g, tile = group_ids[v], tile_ids[v]
    start, end = group_offsets[g], group_offsets[g + 1]
    row0 = tile * tm
    real = v < num_visits[0]
    overlaps = jnp.maximum(start, row0) < jnp.minimum(end, row0 + tm)  # this group has rows here

    @pl.when(k == 0)
    def _():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    def dequantized_rhs():
        if quant == "int8":  # int8 -> fp32 -> lhs dtype: exact (|q| <= 127)
            return rhs_ref[...].astype(jnp.float32).astype(lhs_ref.dtype)
        tk = rhs_ref.shape[0]  # fp8: per 128-row chunk, decode the bits, times the chunk's (1, tn) scale row
        for c in range(-(-tk // _FP8_BLOCK)):
            r0, r1 = c * _FP8_BLOCK, min((c + 1) * _FP8_BLOCK, tk)
            w = _decode_e4m3(rhs_ref[r0:r1, :]) * scale_ref[c:c + 1, :]
            deq_ref[r0:r1, :] = w.astype(deq_ref.dtype)
        return deq_ref[...]

    @pl.when(real & overlaps)
    def _():
        if quant is None:
            acc_ref[...] += jnp.dot(lhs_ref[...], rhs_ref[...], preferred_element_type=jnp.float32)
        else:
            lhs = lhs_ref[...]
            acc_ref[...] += jnp.dot(lhs, dequantized_rhs(), preferred_element_type=jnp.float32)

    @pl.when(real & (k == nk - 1))
    def _():
        rows = row0 + jax.lax.broadcasted_iota(jnp.int32, (tm, tn), 0)
        in_group = (rows >= start) & (rows < end)
        first = (v == 0) | (tile_ids[jnp.maximum(v - 1, 0)] != tile)  # earlier visits wrote other rows
        keep = jnp.where(first, jnp.zeros((tm, tn), out_ref.dtype), out_ref[...])
        acc = acc_ref[...] * scale_ref[...] if quant == "int8" else acc_ref[...]  # (tm, tn) x (1, tn)
        out_ref[...] = jnp.where(in_group, acc.astype(out_ref.dtype), keep)


def _compiler_params(ndims_parallel: int, ndims: int):
    from jax.experimental.pallas import tpu as pltpu
    params_cls = getattr(pltpu, "CompilerParams", None) or getattr(pltpu, "TPUCompilerParams")
    return params_cls(dimension_semantics=("parallel",) * ndims_parallel + ("arbitrary",) * (ndims - ndims_parallel))


@functools.partial(jax.jit, static_argnames=("block_sizes", "interpret", "preferred_element_type", "poison_output"))
def gmm(lhs_MK, rhs_GKN, group_sizes_G, *, rhs_scale=None, block_sizes: GmmBlockSizes | None = None,
        interpret: bool = False, preferred_element_type=None, poison_output: bool = False):
    """Grouped matmul: (M, K) rows sorted by group x (G, K, N) per-group weights -> (M, N).

    group_sizes_G: int (G,), non-negative; rows past their sum give 0 (sums past M are cut at M).
    fp32 accumulation; output dtype `preferred_element_type` (default lhs's). lhs and rhs share one
    dtype (f32 / bf16 / f16), unless rhs is quantized: rhs_scale fp32 (G, 1, N) for an int8 rhs,
    (G, ceil(K/128), ceil(N/128)) for a float8_e4m3fn rhs. interpret=True: the Pallas interpreter;
    poison_output (tests): the output starts as NaN, so an unwritten tile shows up.
    """
    out_dtype = jnp.dtype(lhs_MK.dtype if preferred_element_type is None else preferred_element_type)
    tm, tk, tn = validate(lhs_MK, rhs_GKN, group_sizes_G, block_sizes, out_dtype, rhs_scale)
    quant = None if rhs_scale is None else _QUANT_DTYPES[jnp.dtype(rhs_GKN.dtype)]
    (M, K), N = lhs_MK.shape, rhs_GKN.shape[2]
    if M == 0:
        return jnp.zeros((0, N), out_dtype)
    M_pad = _round_up(M, tm)
    lhs = jnp.pad(lhs_MK, ((0, M_pad - M), (0, 0)))
    group_offsets, group_ids, tile_ids, num_visits = make_group_metadata(group_sizes_G, M, tm)
    V, nk, nn = group_ids.shape[0], K // tk, N // tn

    def k_block(v, k, num_visits):
        # Steps past the last real visit keep the last k block: same indices, so no new DMA.
        return jnp.where(v < num_visits[0], k, nk - 1)

    from jax.experimental.pallas import tpu as pltpu
    lhs_spec = pl.BlockSpec((tm, tk), lambda n, v, k, off, gid, tid, nv: (tid[v], k_block(v, k, nv)))
    rhs_spec = pl.BlockSpec((pl.squeezed, tk, tn), lambda n, v, k, off, gid, tid, nv: (gid[v], k_block(v, k, nv), n))
    out_spec = pl.BlockSpec((tm, tn), lambda n, v, k, off, gid, tid, nv: (tid[v], n))
    in_specs, args, aliases = [lhs_spec, rhs_spec], [lhs, rhs_GKN], {}
    scratch = [pltpu.VMEM((tm, tn), jnp.float32)]
    if quant == "int8":
        in_specs.append(pl.BlockSpec((pl.squeezed, 1, tn), lambda n, v, k, off, gid, tid, nv: (gid[v], 0, n)))
        args.append(rhs_scale)
    elif quant == "fp8":
        args[1] = jax.lax.bitcast_convert_type(rhs_GKN, jnp.int8)  # the e4m3 bits, decoded in the kernel
        kb = -(-tk // _FP8_BLOCK)  # scale rows per K tile (tk is a multiple of 128 or the whole K)
        s_GKN = jnp.repeat(rhs_scale, _FP8_BLOCK, axis=2)[:, :, :N]  # one scale per column
        in_specs.append(pl.BlockSpec((pl.squeezed, pl.squeezed, kb, tn),
                                     lambda n, v, k, off, gid, tid, nv: (gid[v], k_block(v, k, nv), 0, n)))
        args.append(s_GKN.reshape(rhs_GKN.shape[0], nk, kb, N))
        scratch.append(pltpu.VMEM((tk, tn), lhs.dtype))
    if poison_output:
        in_specs.append(out_spec)
        args.append(jnp.full((M_pad, N), jnp.nan, out_dtype))
        aliases = {4 + len(args) - 1: 0}  # operand index counts the 4 scalar-prefetch operands

    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=4,
        grid=(nn, V, nk),
        in_specs=in_specs,
        out_specs=out_spec,
        scratch_shapes=scratch,
    )
    out = pl.pallas_call(
        functools.partial(_gmm_kernel, tm=tm, tn=tn, nk=nk, quant=quant),
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct((M_pad, N), out_dtype),
        input_output_aliases=aliases,
        compiler_params=None if interpret else _compiler_params(1, 3),
        interpret=interpret,
        name="dlm_gmm",
    )(group_offsets, group_ids, tile_ids, num_visits, *args)
    return out[:M]


def _rhs_and_scale(w):
    """(rhs, rhs_scale) for gmm: a plain (E, K, N) array -> (w, None); an in-first QuantizedWeight
    stack -> (q, scale)."""
    if not (hasattr(w, "q") and hasattr(w, "scale")):
        return w, None
    if getattr(w, "out_first", False) or w.q.ndim != 3 or (getattr(w, "n_in", 1), getattr(w, "n_out", 1)) != (1, 1):
        raise ValueError(f"swiglu_experts_gmm: a quantized expert stack must be in-first (E, K, N) with one in and "
                         f"one out dim, got q {tuple(w.q.shape)}")
    return w.q, w.scale


def swiglu_experts_gmm(x_RD, group_sizes_E, w_gate_EDF, w_up_EDF, w_down_EFD, *,
                       block_sizes: GmmBlockSizes | None = None, interpret: bool = False):
    """Rows x_RD sorted by expert (group e: group_sizes_E[e] consecutive rows) -> y_RD =
    down_e(silu(x @ gate_e) * (x @ up_e)), y in x's dtype; same contract as `swiglu_experts_tiled`.
    Matmuls in the weights' dtype (x's for a quantized stack), SwiGLU in fp32.
    """
    (wg, sg), (wu, su), (wd, sd) = (_rhs_and_scale(w) for w in (w_gate_EDF, w_up_EDF, w_down_EFD))
    dt_g, dt_u = (x_RD.dtype if s is not None else w.dtype for w, s in ((wg, sg), (wu, su)))
    x = x_RD.astype(dt_g)
    g_RF = gmm(x, wg, group_sizes_E, rhs_scale=sg, block_sizes=block_sizes, interpret=interpret,
               preferred_element_type=jnp.float32)
    u_RF = gmm(x if dt_u == dt_g else x_RD.astype(dt_u), wu, group_sizes_E, rhs_scale=su, block_sizes=block_sizes, interpret=interpret,
               preferred_element_type=jnp.float32)
    h_RF = (jax.nn.silu(g_RF) * u_RF).astype(x_RD.dtype if sd is not None else wd.dtype)
    y_RD = gmm(h_RF, wd, group_sizes_E, rhs_scale=sd, block_sizes=block_sizes, interpret=interpret,
               preferred_element_type=jnp.float32)
    return y_RD.astype(x_RD.dtype)
