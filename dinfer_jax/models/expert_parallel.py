"""Expert parallelism (EP x TP x DP) for the MoE layer, by hand inside `jax.shard_map` on the
("data", "expert", "model") mesh: experts (E, D, F) split E over "expert" and F over "model", router
replicated; tokens gathered over "expert" when split, routed in fp32, each shard's (token, slot)
pairs sorted to its local experts, partial sums reduced (psum, or psum_scatter + psum). Steps and
quantized scales: docs/internals/model_code.md.
"""
from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from dinfer_jax.models.quant import spec_like


def moe_expert_parallel(x_TD, router_params, w_gate_EDF, w_up_EDF, w_down_EFD, *, mesh, token_axes: tuple,
                        route_fn, local_experts_fn):
    """x_TD (T split over token_axes) -> y_TD, same split. route_fn(x_TD, router_params) ->
    (weights_TX, experts_TX), router_params replicated. local_experts_fn(x_TD, weights_TX, experts_TX,
    w_gate, w_up, w_down): a single-device expert path given local ids (E_local, weight 0: another shard's).
    """
    E = w_gate_EDF.shape[0]
    ep, tp = mesh.shape["expert"], mesh.shape["model"]
    if E % ep:
        raise ValueError(f"{E} experts do not split over expert axis of size {ep}")
    E_local = E // ep
    gather = "expert" in token_axes
    tok = P(token_axes if token_axes else None, None)

    def local(x, rp, w_gate, w_up, w_down):
        if gather:
            x = jax.lax.all_gather(x, "expert", axis=0, tiled=True)
        weights_TX, experts_TX = route_fn(x, rp)
        local_id = experts_TX - jax.lax.axis_index("expert") * E_local
        mine = (local_id >= 0) & (local_id < E_local)
        y = local_experts_fn(x, jnp.where(mine, weights_TX, 0.0), jnp.where(mine, local_id, E_local),
                             w_gate, w_up, w_down)
        if gather:  # scatter first: the "model" all-reduce then moves 1/ep of the rows
            y = jax.lax.psum_scatter(y, "expert", scatter_dimension=0, tiled=True)
            return jax.lax.psum(y, "model") if tp > 1 else y
        return jax.lax.psum(y, ("expert", "model"))

    fn = partial(jax.shard_map, mesh=mesh, check_vma=False,
                 in_specs=(tok, P(), spec_like(w_gate_EDF, P("expert", None, "model")),
                           spec_like(w_up_EDF, P("expert", None, "model")),
                           spec_like(w_down_EFD, P("expert", "model", None))),
                 out_specs=tok)(local)
    return fn(x_TD, router_params, w_gate_EDF, w_up_EDF, w_down_EFD)
