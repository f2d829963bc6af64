"""Ahead-of-time export of the whole jitted generate program for an accelerator, from any host:
`export_generate(cfg, "tpu" | "cuda" | "cpu", ...)` -> ExportReport (docs/internals/runtime.md).

  python -m dinfer_jax.aot --model llada-8b --platform tpu cuda --cache none dual --batch 1 16 \
      [--mesh data=2,expert=4 --fake-devices 8] [--json OUT.json]   # one table row per export
"""
from __future__ import annotations

import contextlib
import dataclasses
import time
from typing import Any

import jax
import jax.extend  # noqa: F401  (jax.extend.core.{Jaxpr, ClosedJaxpr} for the jaxpr walk)
import jax.numpy as jnp

from dinfer_jax.cache import cache_shape
from dinfer_jax.config import ModelConfig

# Custom-call targets of the hardware kernels in exported StableHLO.
MOSAIC_TPU = "tpu_custom_call"
TRITON = "__gpu$xla.gpu.triton"
# jax.export refuses custom calls without a compatibility guarantee. The only safety checks
# disabled: the Triton call's, for GPU exports, and the KV cache's layout pin's (cache.row_major,
# an XLA layout hint), for TPU exports.
TRITON_DISABLED_CHECK = TRITON
LAYOUT_PIN = "LayoutConstraint"
GPU_DEVICE_KIND = "NVIDIA H100"  # the abstract GPU newer jax asks for when lowering Triton off-GPU
EXPORT_PLATFORMS = ("tpu", "cuda", "rocm", "cpu")


@dataclasses.dataclass
class ExportReport:
    """One exported generate program. n_mosaic / n_triton: hardware kernel calls in the StableHLO;
    n_interpreted: Pallas calls in the traced program that run in the interpreter (0 expected)."""
    platform: str
    batch: int
    canvas_length: int
    sampling: Any
    exported: Any  # jax.export.Exported
    seconds: float
    bytes: int
    n_mosaic: int
    n_triton: int
    n_interpreted: int
    n_pallas: int

    def row(self) -> dict:
        return dict(platform=self.platform, batch=self.batch, canvas=self.canvas_length, cache=self.sampling.cache,
                    mosaic_calls=self.n_mosaic, triton_calls=self.n_triton, interpreted=self.n_interpreted,
                    mib=round(self.bytes / 2**20, 2), lower_s=round(self.seconds, 2))


def gpu_target(device_kind: str = GPU_DEVICE_KIND, mesh=None):
    """Context naming an abstract GPU so Triton kernels lower on a host without one (newer jax); not
    with a multi-device mesh, where newer jax cannot lower Triton off-GPU (docs/accelerators.md)."""
    if not hasattr(jax.sharding, "AbstractDevice") or (mesh is not None and mesh.size > 1):
        return contextlib.nullcontext()
    dev = jax.sharding.AbstractDevice(device_kind=device_kind, num_cores=None, platform="gpu")
    mesh = jax.sharding.AbstractMesh((1,), ("gpu_target",), axis_types=(jax.sharding.AxisType.Auto,),
                                     abstract_device=dev)
    return jax.sharding.use_abstract_mesh(mesh)


def _sub_jaxprs(params):
    for v in params.values():
        for x in (v if isinstance(v, (list, tuple)) else (v,)):
            if isinstance(x, jax.extend.core.ClosedJaxpr):
                yield x.jaxpr
            elif isinstance(x, jax.extend.core.Jaxpr):
                yield x


def pallas_calls(jaxpr) -> list[dict]:
    """Every pallas_call in a (closed) jaxpr, nested ones included: [{name, interpret}]."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    out = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            interp = eqn.params.get("interpret", False)
            out.append(dict(name=str(getattr(eqn.params.get("debug_info"), "func_name", eqn.params.get("name", ""))),
                            interpret=bool(interp)))
        for sub in _sub_jaxprs(eqn.params):
            out.extend(pallas_calls(sub))
    return out


def abstract_model(cfg: ModelConfig, platform: str, *, dtype=jnp.bfloat16, mesh=None, attention_impl: str = "auto",
                   moe_impl: str = "auto", quantize: str | None = None):
    """A Model over ShapeDtypeStruct params (sharded over `mesh` when given) targeting `platform`;
    quantize "int8" | "fp8": the quantized params as QuantizedWeight (models/quant.py)."""
    from dinfer_jax.model import Model
    from dinfer_jax.models import abstract_params, placement, unflatten
    from dinfer_jax.models.quant import pack_flat, quantize_abstract, unpack_flat
    flat = abstract_params(cfg, dtype)
    if quantize is not None:
        flat = quantize_abstract(flat, quantize)
    if mesh is not None:
        placement.check_mesh_fits(cfg, mesh)
        leaves, quantization = unpack_flat(flat)
        shardings = placement.param_shardings(cfg, mesh, {k: v.shape for k, v in leaves.items()}, quantization)
        leaves = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=shardings[k]) for k, v in leaves.items()}
        flat = pack_flat(leaves, quantization)
    return Model(cfg, unflatten(flat), moe_impl, attention_impl, mesh, platform)


def export_generate(cfg: ModelConfig, platform: str, *, batch: int = 1, prompt_len: int = 64, sampling=None,
                    dtype=jnp.bfloat16, mesh=None, attention_impl: str = "auto", moe_impl: str = "auto",
                    model=None) -> ExportReport:
    """Export the Generator's jitted program for `batch` prompts of `prompt_len` tokens with
    SamplingParams `sampling` for `platform` (see module doc). model: reuse an abstract_model."""
    from dinfer_jax.engine import SamplingParams
    if platform not in EXPORT_PLATFORMS:
        raise ValueError(f"export platform {platform!r} is not one of {EXPORT_PLATFORMS}")
    if batch <= 0 or prompt_len <= 0:
        raise ValueError(f"batch={batch} and prompt_len={prompt_len} must be positive")
    sampling = SamplingParams() if sampling is None else sampling
    if model is None:
        model = abstract_model(cfg, platform, dtype=dtype, mesh=mesh, attention_impl=attention_impl, moe_impl=moe_impl)
    elif model.target_platform != platform:
        raise ValueError(f"model targets {model.target_platform!r}, not {platform!r}")
    prog, sds, _, shape = model.generator.abstract_program(batch, prompt_len, sampling)
    return _export(prog, sds, platform, model.mesh, sampling, (shape.batch, shape.canvas_length))


def _export(prog, sds, platform: str, mesh, sampling, canvas_shape, static=()) -> ExportReport:
    """jax.export one jitted program (abstract args `sds`, then the `static` ones) for `platform`."""
    from jax import export
    gpu = platform in ("cuda", "rocm")
    # Triton calls and (TPU) the cache's layout pin (cache.row_major) have no stability guarantee
    unstable = {"cuda": TRITON_DISABLED_CHECK, "rocm": TRITON_DISABLED_CHECK, "tpu": LAYOUT_PIN}.get(platform)
    checks = [export.DisabledSafetyCheck.custom_call(unstable)] if unstable else []
    with gpu_target(mesh=mesh) if gpu else contextlib.nullcontext():
        t = time.perf_counter()
        exp = export.export(prog, platforms=[platform], disabled_checks=checks)(*sds, *static)
        seconds = time.perf_counter() - t
        calls = pallas_calls(prog.trace(*sds, *static).jaxpr)
    text = exp.mlir_module()
    return ExportReport(platform, canvas_shape[0], canvas_shape[1], sampling, exp, seconds,
                        len(exp.mlir_module_serialized), text.count(MOSAIC_TPU), text.count(TRITON),
                        sum(c["interpret"] for c in calls), len(calls))


def segment_program_args(model, *, batch: int, prompt_len: int, sampling, prefix_width: int | None = None) -> dict:
    """The continuous-batching programs for `batch` slots of prompts up to `prompt_len` tokens:
    {name: (jitted fn, abstract args, static args)} for "init", "segment" and, for block diffusion
    with prefix_width, "init_prefix" (decoding/segments.py)."""
    from dinfer_jax.decoding.spec import ROW_KNOBS, RowKnobs
    cfg = model.config
    spec = sampling.spec_for(cfg)
    shape = model.generator.program_shape(batch, prompt_len, spec)  # the generate program's canvas layout
    gen_start, Lc = shape.gen_start, shape.canvas_length
    init, segment, _, init_prefix = model.generator.segment_programs(spec, gen_start, batch)
    sd = jax.ShapeDtypeStruct
    row = lambda dt: sd((batch,), dt, sharding=model.batch_sharding((batch,)))
    knobs = RowKnobs.build(lambda k, dt: row(dt), ROW_KNOBS)
    params = model.abstract_params()
    args = (params, sd((batch, Lc), jnp.int32, sharding=model.batch_sharding((batch, Lc))), row(jnp.int32),
            row(jnp.int32), row(jnp.bool_), knobs)
    state = jax.eval_shape(init, *args)
    out = {"init": (init, args, ()),
           "segment": (segment, (params, state, args[2], args[3], knobs, sd((), jnp.int32, sharding=model.replicated())),
                       ())}
    if prefix_width is not None:
        if spec.cache != "block":
            raise ValueError("the prefix prefill exists for block diffusion (cache='block') only")
        kv = sd(cache_shape(cfg.num_layers, batch, gen_start, cfg.num_kv_heads, cfg.head_dim), model.module.dtype,
                sharding=model.replicated())
        out["init_prefix"] = (init_prefix, args + ((kv, kv),), (prefix_width,))
    return out


def export_segment_programs(cfg: ModelConfig, platform: str, *, batch: int = 4, prompt_len: int = 64, sampling=None,
                            model=None, prefix_width: int | None = None) -> dict[str, ExportReport]:
    """Export the continuous-batching programs (see `segment_program_args`) -> {name: ExportReport}."""
    from dinfer_jax.engine import SamplingParams
    sampling = SamplingParams() if sampling is None else sampling
    if model is None:
        model = abstract_model(cfg, platform)
    elif model.target_platform != platform:
        raise ValueError(f"model targets {model.target_platform!r}, not {platform!r}")
    progs = segment_program_args(model, batch=batch, prompt_len=prompt_len, sampling=sampling,
                                 prefix_width=prefix_width)
    return {name: _export(fn, args, platform, model.mesh, sampling, args[1].shape if name != "segment" else
                          progs["init"][1][1].shape, static=static)
            for name, (fn, args, static) in progs.items()}


def main(argv=None):
    import argparse
    import json
    import os
    ap = argparse.ArgumentParser(prog="python -m dinfer_jax.aot", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", nargs="+", default=["llada-moe-7b-a1b"], help="config presets")
    ap.add_argument("--platform", nargs="+", default=["tpu", "cuda"], choices=EXPORT_PLATFORMS)
    ap.add_argument("--cache", nargs="+", default=["dual"], choices=["none", "prefix", "dual", "vicinity"])
    ap.add_argument("--batch", nargs="+", type=int, default=[1])
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--gen-length", type=int, default=128)
    ap.add_argument("--block-length", type=int, default=64)
    ap.add_argument("--mesh", default=None, help="sharding mesh spec, e.g. data=2,expert=4")
    ap.add_argument("--fake-devices", type=int, default=0, help="this many fake CPU devices (for --mesh)")
    ap.add_argument("--json", default=None, help="write the rows here")
    a = ap.parse_args(argv)
    if a.fake_devices:  # read when the CPU backend starts, i.e. before the first device query below
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={a.fake_devices}"
    from dinfer_jax import sharding as shd
    from dinfer_jax.families import preset
    from dinfer_jax.engine import SamplingParams
    mesh = shd.make_mesh(a.mesh) if a.mesh else None
    rows = []
    for name in a.model:
        cfg = preset(name)
        for platform in a.platform:
            model = abstract_model(cfg, platform, mesh=mesh)
            for cache in a.cache:
                for batch in a.batch:
                    sp = SamplingParams(gen_length=a.gen_length, block_length=a.block_length, cache=cache)
                    r = export_generate(cfg, platform, batch=batch, prompt_len=a.prompt_len, sampling=sp, model=model)
                    row = dict(model=name, mesh=shd.mesh_summary(mesh), **r.row())
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
