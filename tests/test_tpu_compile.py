"""Compiled for TPU, not only lowered: libtpu's compile-only devices (no TPU attached) run the real
XLA:TPU compile (SPMD partitioner, memory assignment) and the Mosaic compiler (VMEM budgets) on
our programs. Skipped, with the reason, when libtpu is not installed (pip install -e '.[tpu]').

Matrix: the attention kernel at every shape of tests/test_attention_lowering.py (one v5e chip);
the grouped matmul with bf16 / int8 / fp8 experts at LLaDA-MoE-7B-A1B sizes; whole programs via
`dinfer_jax.plan`: LLaDA-MoE-7B-A1B generate on v5e:1x1 (checked against an independent
jit(...).lower(...).compile()), LLaDA2-mini block diffusion on v5e:2x2 expert=4, 7B-A1B on
v5e:2x4 with data, expert and model axes all 2, the continuous-batching programs, and an int8
program. Each asserts: compiled, Mosaic calls present, nothing interpreted, fits the chip's HBM.
"""
import importlib.util
import os
import subprocess
import sys
import time

import pytest

HAVE_LIBTPU = importlib.util.find_spec("libtpu") is not None
needs_libtpu = pytest.mark.skipif(not HAVE_LIBTPU, reason="libtpu is not installed: pip install -e '.[tpu]' "
                                                          "to compile for TPU topologies")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GiB = 2**30
ROWS = []


@pytest.fixture(scope="module", autouse=True)
def _report():
    yield
    for r in ROWS:
        print(r)


_PLANS = {}


def _plan(preset_name, topology, mesh, **kw):
    """plan.plan's JSON for a preset (gen 256 unless given, the family's cache); cached per args."""
    key = (preset_name, topology, mesh, tuple(sorted(kw.items())))
    if key not in _PLANS:
        _PLANS[key] = _plan_uncached(preset_name, topology, mesh, **kw)
    return _PLANS[key]


def _plan_uncached(preset_name, topology, mesh, **kw):
    from dinfer_jax import plan
    from dinfer_jax.families import preset
    from dinfer_jax.engine import SamplingParams
    cfg = preset(preset_name)
    block = cfg.attention_mask == "block_causal"
    sp = SamplingParams(gen_length=kw.pop("gen_length", 256), block_length=cfg.block_size or 32,
                        cache="block" if block else "dual")
    out = plan.plan(cfg, topology, mesh, find_batch=False, sampling=sp, **kw)
    ROWS.append(dict(model=preset_name, topology=topology, mesh=out["mesh"],
                     gib=round(out["per_chip_bytes"]["total"] / GiB, 2), s=out["compile_seconds"]))
    return out


def _check(out, min_mosaic=1):
    assert out["compiled"] and out["fits"], out
    assert out["mosaic_calls"] >= min_mosaic and out["interpreted"] == 0
    assert out["per_chip_bytes"]["total"] <= out["hbm_bytes"]
    assert out["audits"]["host_callbacks_in_loop"] == 0


# ------------------------------------------------------------------------------ kernels
@needs_libtpu
def test_attention_kernel_compiles_at_every_lowering_shape():
    """Every (heads, window, block mask) of the lowering matrix compiles with Mosaic for one v5e chip
    (VMEM budgets are checked here, not by the lowering)."""
    import jax
    import jax.numpy as jnp
    from test_attention_lowering import HEADS, WINDOWS

    from dinfer_jax import plan
    from pallas_kernels.attention import flash_attention
    dev = plan.get_topology("v5e:1x1").devices[0]
    one = jax.sharding.SingleDeviceSharding(dev)
    sds = lambda s, dt: jax.ShapeDtypeStruct(s, dt, sharding=one)
    t = time.perf_counter()
    for block_size in (0, 32):
        f = jax.jit(lambda q, k, v, m, qp, kp: flash_attention(q, k, v, m, q_pos_BS=qp, k_pos_BL=kp,
                                                               block_size=block_size, backend="tpu"))
        for N, K, H in HEADS:
            for B, S, L in WINDOWS:
                c = f.lower(sds((B, S, N, H), jnp.bfloat16), sds((B, L, K, H), jnp.bfloat16),
                            sds((B, L, K, H), jnp.bfloat16), sds((B, L), jnp.bool_), sds((B, S), jnp.int32),
                            sds((B, L), jnp.int32)).compile()
                assert c.as_text().count('custom_call_target="tpu_custom_call"') == 1, (N, K, H, B, S, L)
    ROWS.append(dict(attention_compiles=2 * len(HEADS) * len(WINDOWS), s=round(time.perf_counter() - t, 1)))


@needs_libtpu
@pytest.mark.parametrize("kind,F", [(None, 1024), ("int8", 1024), ("fp8", 1024), (None, 192), ("fp8", 192)])
def test_grouped_matmul_compiles(kind, F):
    """The SwiGLU expert GMM at LLaDA-MoE-7B-A1B sizes (E 64, D 2048, F 1024, 384 rows) compiles
    with Mosaic for one v5e chip with bf16, int8 and fp8 experts (three kernel calls); and at F 192,
    SDAR-30B-A3B's expert FFN (768) split over model=4, where 128-wide blocks do not divide F."""
    import jax
    import jax.numpy as jnp

    from dinfer_jax import plan
    from dinfer_jax.models import quant
    from pallas_kernels.moe.gmm import swiglu_experts_gmm
    one = jax.sharding.SingleDeviceSharding(plan.get_topology("v5e:1x1").devices[0])
    E, D, R = 64, 2048, 384
    ws = {f"mlp/{n}": jax.ShapeDtypeStruct(s, jnp.bfloat16, sharding=one)
          for n, s in (("gate_proj", (E, D, F)), ("up_proj", (E, D, F)), ("down_proj", (E, F, D)))}
    if kind is not None:
        ws = quant.quantize_abstract(ws, kind)
        ws = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=one), ws)
    f = jax.jit(lambda x, g, a, b, c: swiglu_experts_gmm(x, g, a, b, c))
    c = f.lower(jax.ShapeDtypeStruct((R, D), jnp.bfloat16, sharding=one),
                jax.ShapeDtypeStruct((E,), jnp.int32, sharding=one),
                ws["mlp/gate_proj"], ws["mlp/up_proj"], ws["mlp/down_proj"]).compile()
    assert c.as_text().count('custom_call_target="tpu_custom_call"') == 3


# ------------------------------------------------------------------------------ programs
@needs_libtpu
def test_7b_a1b_generate_on_one_v5e_matches_an_independent_compile():
    """plan's per-chip numbers equal a direct jit(...).lower(...).compile() of the Generator's
    program built here from the topology, a mesh over its one device and abstract params."""
    import jax
    import numpy as np
    from jax.experimental import topologies

    from dinfer_jax.aot import abstract_model
    from dinfer_jax.families import preset
    from dinfer_jax.engine import SamplingParams
    out = _plan("llada-moe-7b-a1b", "v5e:1x1", None)
    _check(out, min_mosaic=2)  # attention and the grouped matmul
    assert out["mesh"] == {"data": 1, "expert": 1, "model": 1} and out["chips"] == 1
    assert sum(v["count"] for v in out["collectives"].values()) == 0  # one chip: nothing to communicate
    assert out["audits"]["no_full_expert_gather"]
    # independent: topology, mesh, compile and memory stats straight from jax
    topo = topologies.get_topology_desc(topology_name="v5e:1x1", platform="tpu", chips_per_host_bounds=(1, 1, 1))
    mesh = jax.sharding.Mesh(np.array(topo.devices).reshape(1, 1, 1), ("data", "expert", "model"))
    cfg = preset("llada-moe-7b-a1b")
    model = abstract_model(cfg, "tpu", mesh=mesh)
    prog, args, *_ = model.generator.abstract_program(1, 256, SamplingParams(gen_length=256, block_length=32))
    ma = prog.lower(*args).compile().memory_analysis()
    pc = out["per_chip_bytes"]
    assert pc["arguments"] == ma.argument_size_in_bytes and pc["temp"] == ma.temp_size_in_bytes
    # the weights dominate: bf16 params of the preset (num_params x 2 bytes) within 1%
    assert abs(ma.argument_size_in_bytes - 2 * cfg.num_params) < 0.01 * 2 * cfg.num_params
    assert out["predicted"]["bytes_per_forward"] >= 2 * cfg.num_params


@needs_libtpu
def test_llada2_mini_block_diffusion_on_v5e_2x2_expert_parallel():
    out = _plan("llada2-mini", "v5e:2x2", "expert=4")
    _check(out, min_mosaic=2)
    assert out["mesh"] == {"data": 1, "expert": 4, "model": 1} and out["chips"] == 4
    assert out["audits"]["no_full_expert_gather"]
    # each chip holds a quarter of the experts: well under the whole model's bf16 bytes
    from dinfer_jax.families import preset
    assert out["per_chip_bytes"]["arguments"] < 0.5 * 2 * preset("llada2-mini").num_params


@needs_libtpu
def test_kv_cache_is_updated_in_place():
    """The audit finds no KV-cache-shaped relayout copy inside the loop. With the cache stored
    (layers, B, L, K, H), XLA:TPU relaid out the whole 20-layer K and V caches of LLaDA2-mini (K = 4)
    4 times per iteration on this mesh; stored (layers, B, L, K*H) it has none (dinfer_jax/cache.py)."""
    out = _plan("llada2-mini", "v5e:2x2", "expert=4")
    assert out["audits"]["kv_copies_in_loop"] == 0 and out["audits"]["kv_cache_in_place"]


@pytest.mark.smoke
def test_kv_copy_audit_sees_either_cache_layout():
    """plan.cache_copies flags a copy inside a loop of a cache-shaped buffer in the merged (K*H) or the
    split (K, H) layout, at least one layer's size; not fusion-internal copies, loop-free ones or
    small ones, nor a one-layer merged copy when K*H is the hidden size (it may be activations)."""
    from dinfer_jax.plan import Instr, cache_copies
    L, K, H = 544, 4, 128
    layer = L * K * H

    def copy(dims, in_loop=True, computation="region_1", opcode="copy"):
        n = 1
        for d in dims:
            n *= d
        return Instr(computation, "copy.1", (2 * n,), opcode, in_loop, "", (dims,))
    found = cache_copies([copy((20, 1, L, K * H)), copy((20, 1, L, K, H)), copy((1, L, K, H)),
                          copy((20, 1, L, K * H), in_loop=False), copy((20, 1, L, K * H), computation="fused_computation.3"),
                          copy((1, 32, L)), copy((1, 8, K * H)), copy((20, 1, L, K * H), opcode="copy-start")],
                         L, K, H, layer)
    assert [i.dims for i in found] == [((20, 1, L, K * H),), ((20, 1, L, K, H),), ((1, L, K, H),)]
    # K*H == hidden size: a (B, L, D) copy may be a hidden state; the stacked merged cache still counts
    found = cache_copies([copy((1, L, K * H)), copy((20, 1, L, K * H)), copy((1, L, K, H))], L, K, H, layer,
                         hidden_size=K * H)
    assert [i.dims for i in found] == [((20, 1, L, K * H),), ((1, L, K, H),)]
    # the canvas length equal to K*H (LLaDA-8B on v7x under model=8: L = 512 = 4 heads x 128): a
    # (B, L, D) hidden state or an (L, F) activation is no cache; a (B, K, 1, L, H) K/V slice is
    L2, K2, D = 512, 4, 4096
    found = cache_copies([copy((1, L2, D)), copy((L2, 1536)), copy((1, K2, 1, L2, H))], L2, K2, H, L2 * K2 * H,
                         hidden_size=D)
    assert [i.dims for i in found] == [((1, K2, 1, L2, H),)]


@needs_libtpu
def test_kv_layout_pin_is_partitioned_on_a_data_model_mesh():
    """The KV cache's layout pin (cache.row_major) on a batch- and head-sharded mesh: no KV copy in
    the loop and no all-gather of K/V (outside a shard_map XLA replicated K/V around the pin: 16
    all-gathers, 71 MB in all, 8 MiB the largest, for LLaDA-8B on v5e:2x4 data=2,model=4)."""
    out = _plan("llada-8b", "v5e:2x4", "data=2,model=4", batch=2)
    _check(out)
    layer_kv_shard = 1 * 512 * (32 // 4) * 128 * 2  # one row, canvas 512, 8 local kv heads, bf16
    assert out["audits"]["kv_copies_in_loop"] == 0, out["audits"]
    assert out["audits"]["largest_all_gather_bytes"] < layer_kv_shard, out["collectives"]


@needs_libtpu
def test_data_expert_model_mesh_on_v5e_2x4():
    """Every mesh axis > 1: collectives appear (the expert exchange and the tensor-parallel
    reductions), none gathers a full expert stack."""
    out = _plan("llada-moe-7b-a1b", "v5e:2x4", "data=2,expert=2,model=2", batch=2)
    _check(out, min_mosaic=2)
    assert out["mesh"] == {"data": 2, "expert": 2, "model": 2}
    assert out["collectives"]["all-reduce"]["count"] + out["collectives"]["all-to-all"]["count"] > 0
    assert out["audits"]["no_full_expert_gather"]


@needs_libtpu
def test_continuous_batching_programs_compile():
    """The server's init + segment programs (4 slots, block diffusion) for LLaDA2-mini on v5e:2x2."""
    out = _plan("llada2-mini", "v5e:2x2", "expert=4", programs="serving", batch=4, gen_length=64)
    _check(out, min_mosaic=2)
    assert out["programs"] == ["init", "segment"]


@needs_libtpu
def test_int8_program_compiles_and_halves_the_weights():
    from dinfer_jax.families import preset
    out = _plan("llada-moe-7b-a1b", "v5e:1x1", None, quantize="int8", gen_length=64)
    _check(out, min_mosaic=2)
    n = preset("llada-moe-7b-a1b").num_params
    assert out["per_chip_bytes"]["arguments"] < 0.65 * 2 * n  # 1-byte experts (+ scales, bf16 embeddings)


@needs_libtpu
def test_observer_program_has_a_host_callback_in_the_loop():
    """Negative control for the callback audit: the observed program (one callback per step) is
    flagged, on the tiny model (no kernels needed: the count is read off the compiled HLO)."""
    import jax
    import jax.numpy as jnp

    from dinfer_jax import plan
    from dinfer_jax.aot import abstract_model
    from dinfer_jax.families import preset
    from dinfer_jax.engine import SamplingParams
    topo = plan.get_topology("v5e:1x1")
    model = abstract_model(preset("tiny"), "tpu", dtype=jnp.float32, mesh=plan.topology_mesh(topo, None),
                           attention_impl="xla", moe_impl="tiled")
    counts = []
    for observe in (False, True):
        prog, args, *_ = model.generator.abstract_program(1, 8, SamplingParams(gen_length=16, block_length=8),
                                                          observe=observe)
        counts.append(plan.host_callbacks(plan.hlo_instructions(prog.lower(*args).compile().as_text())))
    assert counts[0] == 0 and counts[1] >= 1, counts
    del jax


@needs_libtpu
def test_constrained_program_compiles_for_tpu():
    """A canvas-template program (infill / structured output: per-position token sets of 8 classes
    applied inside the loop) compiles for v5e with the TPU kernels, with no host callback."""
    import jax.numpy as jnp

    from dinfer_jax import plan
    from dinfer_jax.aot import abstract_model
    from dinfer_jax.families import preset
    from dinfer_jax.engine import SamplingParams
    topo = plan.get_topology("v5e:1x1")
    model = abstract_model(preset("tiny"), "tpu", dtype=jnp.bfloat16, mesh=plan.topology_mesh(topo, None))
    prog, args, spec, _ = model.generator.abstract_program(2, 8, SamplingParams(gen_length=32, block_length=16),
                                                           constraint_classes=8)
    assert spec.constraint_classes == 8 and args[5].allowed.shape == (2, 8, model.config.vocab_size)
    hlo = prog.lower(*args).compile().as_text()
    assert plan.host_callbacks(plan.hlo_instructions(hlo)) == 0


# ------------------------------------------------------------------------------ CLI
def _cli(*args, env_extra=None, pre=""):
    code = f"{pre}from dinfer_jax.cli import main; main({list(args)!r})"
    env = {**os.environ, "PYTHONPATH": ROOT, **(env_extra or {})}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)


@pytest.mark.parametrize("args,msg", [
    (("--preset", "tiny", "--topology", "potato"), "expected GENERATION:SHAPE"),
    (("--preset", "no-such", "--topology", "v5e:2x2"), "unknown preset 'no-such'"),
    (("--preset", "tiny", "--topology", "v9z:2x2"), "is not one libtpu knows"),
    (("--preset", "tiny", "--topology", "v5e:2x2", "--mesh", "data=3"), "needs 3 devices but 4"),
])
@needs_libtpu
def test_plan_bad_input_is_one_line_exit_2(args, msg):
    r = _cli("plan", *args)
    assert r.returncode == 2, r.stderr[-2000:]
    err = [ln for ln in r.stderr.splitlines() if ln.startswith("dinfer-jax: error:")]
    assert len(err) == 1 and msg in err[0], r.stderr[-2000:]
    assert "Traceback" not in r.stderr


def test_plan_without_libtpu_names_the_extra():
    """Runs everywhere: libtpu hidden from the import system."""
    r = _cli("plan", "--preset", "tiny", "--topology", "v5e:2x2", pre="import sys; sys.modules['libtpu'] = None; ")
    assert r.returncode == 2
    assert "dinfer-jax: error: compiling for TPU needs libtpu: pip install -e '.[tpu]'" in r.stderr


@needs_libtpu
def test_plan_json_fields_and_unfit_model(tmp_path):
    """--model reads only config.json (no weights in the folder); LLaDA-8B at twice its depth (16B
    params, 32 GB of bf16) fits no mesh of one v5e chip: fits false, a reason, exit 0."""
    import dataclasses
    import json

    from dinfer_jax.families import preset, to_hf_dict
    cfg = dataclasses.replace(preset("llada-8b"), num_layers=64)
    (tmp_path / "config.json").write_text(json.dumps(to_hf_dict(cfg)))
    r = _cli("plan", "--model", str(tmp_path), "--topology", "v5e:1x1", "--gen-length", "64", "--no-find-batch",
             "--every-mesh", "--json")
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    for k in ("compiled", "topology", "device_kind", "chips", "mesh", "per_chip_bytes", "hbm_bytes", "fits",
              "mosaic_calls", "collectives", "flops", "bytes_accessed", "compile_seconds", "predicted"):
        assert k in out, k
    assert out["fits"] is False and out["compiled"] is False and out["device_kind"] == "TPU v5 lite"
    assert "Ran out of memory on HBM" in out["reason"], out["reason"]  # XLA:TPU's own refusal
    # the default search compiles nothing whose param shard alone exceeds HBM (~28 GiB > 16 GiB)
    r = _cli("plan", "--model", str(tmp_path), "--topology", "v5e:1x1", "--gen-length", "64", "--no-find-batch",
             "--json")
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["fits"] is False and out["compiled"] is False and out["meshes"][0]["compile_seconds"] is None
    assert f"not compiled: the param shard alone is {cfg.num_params * 2 / 2**30:.2f} GiB" in out["reason"], \
        (out["reason"], cfg.num_params)


@needs_libtpu
def test_diffusion_gemma_generate_compiles_with_experts_split(tmp_path):
    """`plan --model` on a diffusion-gemma-tiny folder (config.json only): the whole generate program
    (prefill, canvases, denoising steps, re-encoding) compiles for v5e:2x2 with data=2, expert=2;
    each chip holds half of every expert-axis param (the per-chip param bytes = those computed here
    from the shapes, expert-axis params halved), no whole expert stack is all-gathered (expert
    parallelism in shard_map), no host callback in the loop."""
    import json

    import jax
    import numpy as np

    from dinfer_jax.families import diffusion_gemma as dg
    from dinfer_jax.models.gemma4 import init_params
    hf = dg.PRESETS["diffusion-gemma-tiny"]  # 8 experts
    (tmp_path / "config.json").write_text(json.dumps(hf))
    r = _cli("plan", "--model", str(tmp_path), "--topology", "v5e:2x2", "--mesh", "data=2,expert=2", "--batch", "2",
             "--prompt-len", "16", "--gen-length", "16", "--json")
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["compiled"] and out["fits"] and out["canvases"] == 2 and out["interpreted"] == 0
    assert out["mesh"] == {"data": 2, "expert": 2, "model": 1}
    assert out["audits"]["host_callbacks_in_loop"] == 0
    # expert parallelism moves tokens, not weights: no all-gather of a whole expert stack
    assert out["audits"]["no_full_expert_gather"], out["audits"]
    assert out["collectives"]["all-reduce"]["count"] > 0  # the experts' partial sums
    cfg, _ = dg.config_from_hf(hf)
    leaves = jax.tree_util.tree_flatten_with_path(jax.eval_shape(lambda: init_params(cfg)))[0]
    bf16 = lambda x: int(np.prod(x.shape)) * 2
    expert = sum(bf16(x) for p, x in leaves  # the expert stacks and the router's per-expert scale
                 if "experts" in jax.tree_util.keystr(p) or "per_expert_scale" in jax.tree_util.keystr(p))
    want = sum(bf16(x) for _, x in leaves) - expert // 2
    assert out["param_bytes_per_chip"] == want
    # + prompt, draws, knobs, and XLA:TPU's tile padding of the many tiny 1-D params at these sizes
    assert want <= out["per_chip_bytes"]["arguments"] <= 2 * want

