"""Expert parallelism (EP x TP x DP) for the MoE layer, by hand inside `jax.shard_map`.

Mesh ("data", "expert", "model"). Expert weights (E, D, F) are split E over "expert" and F over
"model"; the router (D, E) is replicated. Tokens x_TD arrive split like the batch (`token_axes`,
from sharding.batch_axes: "data", plus "expert" when the batch divides).

Per device:
  1. tokens split over "expert" are all-gathered over it (every expert shard must see every token
     of its data group); tokens replicated over "expert" are already complete;
  2. route all of them in fp32 (same result on every shard; the router params are replicated);
  3. keep the (token, slot) pairs whose expert lives on this shard, sort them by local expert,
     grouped matmul over the local experts (pairs of other shards sort last and give 0);
  4. y_TD partial sums: over the F slices ("model") and the expert shards ("expert") -> one psum,
     or psum_scatter over "expert" then psum over "model" (on 1/ep of the rows) when step 1 gathered.
Quantized expert weights (models/quant.py) are split like the weights: int8 scales (E, 1, F|D)
follow the out dim; fp8 block scales follow the (in, out) block grid.
No `ragged_dot(group_offset=...)` (it fails on CPU): other shards' pairs are excluded by the sort.
"""
from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from dinfer_jax.models.quant import spec_like


def moe_expert_parallel(x_TD, router_params, w_gate_EDF, w_up_EDF, w_down_EFD, *, mesh, token_axes: tuple,
                        route_fn, local_experts_fn):
    """x_TD (T split over token_axes) -> y_TD, same split.

    route_fn(x_TD, router_params) -> (weights_TX, experts_TX) is moe.route for the model's router;
    router_params (a pytree: router weight, expert bias) is replicated on every device.

    local_experts_fn(x_TD, weights_TX, experts_TX, w_gate, w_up, w_down) is one of moe.py's
    single-device expert paths; it is given local expert ids, with the id E_local (= no group)
    and weight 0 for slots routed to other shards.
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
