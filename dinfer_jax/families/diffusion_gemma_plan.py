"""DiffusionGemma's whole generate program compiled for a TPU topology with libtpu's compile-only
devices (nothing runs, no weights read), over abstract params sharded on a ("data", "expert",
"model") mesh. `compile_plan(cfg, canvas_length, topology, mesh_spec, batch=, prompt_len=,
max_new_tokens=)` -> dict with the fields of `dinfer-jax plan --json` that apply (per_chip_bytes,
fits, collectives, ...); `export_generate` exports the same program for any platform (CUDA
included) from one device. Sharding rules: docs/internals/families.md (DiffusionGemma)."""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from dinfer_jax import plan as tpu_plan
from dinfer_jax import sharding as shd
from dinfer_jax.families import diffusion_gemma as dg
from dinfer_jax.models.gemma4 import Gemma4Config, Gemma4Diffusion


def compile_plan(cfg: Gemma4Config, canvas_length: int, topology: str, mesh_spec=None, *, batch: int = 1,
                 prompt_len: int = 256, max_new_tokens: int = 256, stability_threshold: int = 1,
                 dtype=jnp.bfloat16) -> dict:
    """Compile `generate` for `batch` prompts of `prompt_len` tokens and `max_new_tokens` (whole
    canvases) on the topology's mesh (None: the experts over every device) -> plan JSON (per-chip
    bytes, fit, collectives, compile seconds)."""
    if batch <= 0 or prompt_len <= 0 or max_new_tokens <= 0:
        raise tpu_plan.PlanError(f"batch {batch}, prompt_len {prompt_len} and max_new_tokens {max_new_tokens} "
                                 f"must be positive")
    topo = tpu_plan.get_topology(topology)
    mesh = tpu_plan.topology_mesh(topo, mesh_spec or {"data": 1, "expert": len(topo.devices), "model": 1})
    if batch % math.prod(mesh.shape[a] for a in shd.batch_axes(batch, mesh)):
        raise tpu_plan.PlanError(f"batch {batch} does not split over the mesh {shd.mesh_summary(mesh)}")
    try:
        dg.check_mesh(cfg, mesh)
    except ValueError as e:
        raise tpu_plan.PlanError(str(e)) from None
    params = dg.abstract_params(cfg, dtype, mesh)
    data = NamedSharding(mesh, P(shd.batch_axes(batch, mesh) or None))
    repl = NamedSharding(mesh, P())
    C, n_canvases = canvas_length, -(-max_new_tokens // canvas_length)
    sds = lambda shape, dt, sh: jax.ShapeDtypeStruct(shape, dt, sharding=sh)
    draws = dg._Draws(*(sds((n, batch, C), jnp.int32, repl) for n in (4, 64, 64)))
    knobs = jax.tree_util.tree_map(lambda x: sds(np.shape(x), x.dtype, repl),
                                   dg._Knobs.of(dg.DiffusionGemmaSettings(max_new_tokens=max_new_tokens), False))
    key = jax.eval_shape(lambda: jax.random.PRNGKey(0))
    args = (params, sds((batch, prompt_len), jnp.int32, data), sds((batch, prompt_len), jnp.bool_, data), draws,
            sds(key.shape, key.dtype, repl), knobs)
    static = (Gemma4Diffusion(cfg, dtype, mesh), C, n_canvases, stability_threshold)
    c = tpu_plan.compile_program("generate", _Bound(static), args)
    param_bytes = sum(tpu_plan.shard_bytes(x) for x in jax.tree_util.tree_leaves(params))
    hbm = topo.hbm_bytes_per_device
    expert_stack = cfg.num_experts * cfg.hidden_size * cfg.moe_intermediate_size * np.dtype(dtype).itemsize
    big_gather = tpu_plan.largest(c.instrs, ("all-gather", "all-gather-start"))
    return {"compiled": True, "family": "diffusion_gemma", "topology": topo.name, "device_kind": topo.device_kind,
            "chips": topo.chips, "devices": len(topo.devices), "mesh": {a: mesh.shape[a] for a in shd.MESH_AXES},
            "batch": batch, "prompt_len": prompt_len, "canvas_length": C, "canvases": n_canvases,
            "per_chip_bytes": {"arguments": c.arguments, "temp": c.temp, "code": c.code, "total": c.total},
            "param_bytes_per_chip": param_bytes, "hbm_bytes": hbm, "fits": c.total <= hbm,
            "mosaic_calls": c.mosaic_calls, "interpreted": c.interpreted,
            "collectives": tpu_plan.collectives(c.instrs), "flops": c.flops, "bytes_accessed": c.bytes_accessed,
            "compile_seconds": round(c.seconds, 2),
            "audits": {"host_callbacks_in_loop": tpu_plan.host_callbacks(c.instrs),
                       "largest_all_gather_bytes": big_gather, "expert_stack_bytes": expert_stack,
                       "no_full_expert_gather": big_gather < expert_stack}}


class _Bound:
    """dg._generate with its static arguments bound, as compile_program's `fn` (lower / trace)."""

    def __init__(self, static):
        self.static = static

    def lower(self, *args):
        return dg._generate.lower(*self.static, *args)

    def trace(self, *args):
        return dg._generate.trace(*self.static, *args)


def export_generate(cfg: Gemma4Config, canvas_length: int, platform: str, *, batch: int = 1, prompt_len: int = 256,
                    max_new_tokens: int = 256, stability_threshold: int = 1, dtype=jnp.bfloat16):
    """The whole generate program (one device) exported with jax.export for `platform` ("cuda",
    "tpu", ...) from abstract params: no weights in memory, nothing compiled -> jax.export.Exported."""
    from jax import export
    shapes = dg.abstract_params(cfg, dtype)
    C, n_canvases = canvas_length, -(-max_new_tokens // canvas_length)
    sds = jax.ShapeDtypeStruct
    draws = dg._Draws(*(sds((n, batch, C), jnp.int32) for n in (4, 64, 64)))
    knobs = jax.tree_util.tree_map(lambda x: sds(np.shape(x), x.dtype),
                                   dg._Knobs.of(dg.DiffusionGemmaSettings(max_new_tokens=max_new_tokens), False))
    key = jax.eval_shape(lambda: jax.random.PRNGKey(0))
    fn = jax.jit(functools.partial(dg._generate, Gemma4Diffusion(cfg, dtype), C, n_canvases, stability_threshold))
    return export.export(fn, platforms=[platform])(shapes, sds((batch, prompt_len), jnp.int32),
                                                   sds((batch, prompt_len), jnp.bool_), draws, key, knobs)
