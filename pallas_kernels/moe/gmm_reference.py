"""Pure-JAX grouped matmul (GMM): the reference the Pallas `gmm` kernel is tested against
(M rows sorted by group, K contraction, N output, G groups)."""
from __future__ import annotations

import jax
import jax.numpy as jnp


def group_of_rows(group_sizes_G, num_rows: int):
    """Row -> group id (int32, shape (M,)). Groups are consecutive row ranges in order 0..G-1;
    group g holds rows [sum(sizes[:g]), sum(sizes[:g+1])), clipped to [0, M). Rows past
    sum(group_sizes) get the id G (no group)."""
    ends_G = jnp.minimum(jnp.cumsum(group_sizes_G.astype(jnp.int32)), num_rows)
    return jnp.searchsorted(ends_G, jnp.arange(num_rows, dtype=jnp.int32), side="right").astype(jnp.int32)


def gmm_reference(lhs_MK, rhs_GKN, group_sizes_G, *, preferred_element_type=None):
    """out_MN[m] = lhs_MK[m] @ rhs_GKN[g(m)] (g(m): row m's group; 0 past sum(group_sizes), sums
    past M cut at M), fp32 HIGHEST accumulation, `preferred_element_type` (default lhs's). G dense
    matmuls: for tests.
    """
    M = lhs_MK.shape[0]
    G = rhs_GKN.shape[0]
    out_dtype = lhs_MK.dtype if preferred_element_type is None else preferred_element_type
    y_GMN = jnp.einsum("mk,gkn->gmn", lhs_MK.astype(jnp.float32), rhs_GKN.astype(jnp.float32),
                       precision=jax.lax.Precision.HIGHEST)
    g_M = group_of_rows(group_sizes_G, M)
    y_MN = y_GMN[jnp.minimum(g_M, G - 1), jnp.arange(M)]
    return jnp.where((g_M < G)[:, None], y_MN, 0.0).astype(out_dtype)
