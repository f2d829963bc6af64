"""Param placement on a mesh: each param's sharding from the model's logical-axis declarations
through sharding.LOGICAL_RULES, the mesh-fit check, and placing params as global arrays (kept beside
the model so that sharding.py imports no model)."""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding

from dinfer_jax.models import Transformer, abstract_params, flatten
from dinfer_jax.models.quant import SCALE_SUFFIX, pack_flat, scale_axes, unpack_flat
from dinfer_jax.sharding import ShardingError, logical_spec, mesh_summary, to_global


def param_logical_axes(cfg) -> dict[str, tuple]:
    """{'/'-joined param path: logical axis names} read from the model's own declarations."""
    boxed = jax.eval_shape(lambda: Transformer(cfg).init(jax.random.key(0), jnp.zeros((1, 1), jnp.int32))["params"])
    specs = nn.get_partition_spec(boxed)
    return {k: tuple(v) for k, v in flatten(specs).items()}


def param_shardings(cfg, mesh: Mesh, shapes: dict | None = None,
                    quantization: dict | None = None) -> dict[str, NamedSharding]:
    """{path: NamedSharding} for every param of `cfg` on `mesh`; ShardingError if the mesh does not
    divide the experts, query heads or FFN dim. quantization (a manifest's {path: {kind, n_in, n_out}}):
    `path@scale` leaves get quant.scale_axes (non-strict)."""
    shapes = shapes or {k: v.shape for k, v in abstract_params(cfg).items()}
    axes = param_logical_axes(cfg)
    out = {k: NamedSharding(mesh, logical_spec(axes[k], tuple(shapes[k]), mesh, strict=True, what=k))
           for k in axes}
    for k, m in (quantization or {}).items():
        s_axes = scale_axes(axes[k], m["kind"], m["n_in"], m["n_out"], bool(m.get("out_first", False)))
        s_shape = tuple(shapes[k + SCALE_SUFFIX])
        out[k + SCALE_SUFFIX] = NamedSharding(mesh, logical_spec(s_axes, s_shape, mesh, what=k + SCALE_SUFFIX))
    return out


def check_mesh_fits(cfg, mesh: Mesh):
    """Raise ShardingError naming every param the mesh cannot split (before any data moves)."""
    problems = []
    shapes = {k: v.shape for k, v in abstract_params(cfg).items()}
    axes = param_logical_axes(cfg)
    for k in axes:
        try:
            logical_spec(axes[k], tuple(shapes[k]), mesh, strict=True, what=k)
        except ShardingError as e:
            problems.append(str(e))
    if problems:
        raise ShardingError(f"mesh {mesh_summary(mesh)} does not fit the model: " + "; ".join(problems[:4])
                            + (f" (+{len(problems) - 4} more)" if len(problems) > 4 else ""))


def shard_params(flat: dict, cfg, mesh: Mesh) -> dict:
    """Flat {path: host array, jax.Array or QuantizedWeight} -> the same placed on `mesh`."""
    flat, quantization = unpack_flat(flat)
    if quantization:
        return pack_flat(_shard_leaves(flat, cfg, mesh, quantization), quantization)
    return _shard_leaves(flat, cfg, mesh)


def _shard_leaves(flat: dict, cfg, mesh: Mesh, quantization: dict | None = None) -> dict:
    """shard_params for plain leaves (a quantized model's split into values and path@scale)."""
    shardings = param_shardings(cfg, mesh, {k: np.shape(v) for k, v in flat.items()}, quantization)
    out = {}
    for k, v in flat.items():
        if isinstance(v, jax.Array) and not v.is_fully_addressable:
            out[k] = jax.jit(lambda a: a, out_shardings=shardings[k])(v)
        elif isinstance(v, jax.Array) and jax.process_count() == 1:
            out[k] = jax.device_put(v, shardings[k])
        else:
            out[k] = to_global(v, shardings[k])
    return out
