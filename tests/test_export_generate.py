"""Accelerator truth without an accelerator: the WHOLE jitted generate program (Generator's own
program: while_loop over blocks x steps, every layer, the strategy, the cache policy) exported with
jax.export for TPU (Mosaic) and CUDA (Triton) at full model shapes from abstract params (no weights
in memory), with the hardware kernels chosen by the target platform, not by this CPU host.

Each export must contain the hardware kernel custom calls and no Pallas kernel left to the
interpreter (checked on the traced jaxpr: every pallas_call's `interpret` flag). The only export
safety checks disabled are the Triton custom call's for CUDA (dinfer_jax.aot.TRITON_DISABLED_CHECK)
and the KV cache's layout pin's for TPU (dinfer_jax.aot.LAYOUT_PIN, dinfer_jax/cache.row_major).
Matrix: MODELS x {tpu, cuda} x cache {none, prefix, dual, vicinity, block (LLaDA2 only)} x batch
{1, 16}, prompt 64, gen 128, block 64 (LLaDA2: 32, its attention block), bf16, one device; plus one long canvas per model (prompt 3968 ->
L 4160 on TPU). Kernel-level shapes beyond the models' (GQA 16/4, H 64, L 32k, block-causal) are
in tests/test_attention_lowering.py. Also the continuous-batching programs (init, segment, prefix-cache
prefill) per model x platform at 4 slots, and the Dream / SDAR / Fast-dLLM v2 decoders at their full
shapes. Rows (size, lowering time) are printed at the end (-s).
"""
import functools

import jax.numpy as jnp
import pytest

from dinfer_jax.aot import abstract_model, export_generate
from dinfer_jax.families import preset, presets
from dinfer_jax.engine import SamplingParams

pytestmark = pytest.mark.smoke  # no torch; lowers on the newest jax too

# Adding a model is one line here (LLaDA2-mini joins as soon as its preset exists).
MODELS = [m for m in ("llada-moe-7b-a1b", "llada-8b", "llada2-mini") if m in presets()]
PLATFORMS = ["tpu", "cuda"]
CACHES = ["none", "prefix", "dual", "vicinity", "block"]  # "block": block diffusion (block-causal models only)
BATCHES = [1, 16]
ROWS = []


@functools.lru_cache(maxsize=None)
def _model(name, platform):
    return abstract_model(preset(name), platform)


@pytest.fixture(scope="module", autouse=True)
def _report():
    yield
    if ROWS:
        keys = list(ROWS[0])
        print("\n| " + " | ".join(keys) + " |\n|" + "---|" * len(keys))
        for r in ROWS:
            print("| " + " | ".join(str(r[k]) for k in keys) + " |")


def _check(r, name, cfg):
    ROWS.append(dict(model=name, **r.row()))
    assert r.n_interpreted == 0, "a Pallas kernel would run in the interpreter on the accelerator"
    assert r.n_pallas >= 1
    if r.platform == "tpu":
        assert r.n_mosaic >= 1 and r.n_triton == 0
        if cfg.is_moe:  # attention and the grouped matmul are both Pallas kernels on TPU
            assert r.n_pallas >= 2
    else:
        assert r.n_triton >= 1 and r.n_mosaic == 0
    assert r.bytes > 0 and r.exported.platforms == (r.platform,)


@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("name", MODELS)
def test_generate_program_exports(name, platform, cache, batch):
    cfg = preset(name)
    if cache == "block" and cfg.attention_mask != "block_causal":
        pytest.skip("block diffusion needs a block-causal model")
    sp = SamplingParams(gen_length=128, block_length=cfg.block_size or 64, cache=cache)
    r = export_generate(cfg, platform, batch=batch, prompt_len=64, sampling=sp, model=_model(name, platform))
    assert r.batch == batch and r.canvas_length >= 64 + 128
    _check(r, name, cfg)


# The Qwen-based families with their own decoders, at full shapes: Dream's sampler (shifted logits,
# dual cache), SDAR's block rule (Qwen3 q/k norm, block 4; dense 8B and the 30B-A3B MoE), Fast-dLLM v2's sub-blocks with shifted
# logits on the block path (Qwen2.5-7B: 28/4 heads, a query group of 7, padded to 8 on Triton).
FAMILY_DECODERS = [
    ("dream-7b", dict(gen_length=128, block_length=128, strategy="dream", alg="entropy", steps=128, cache="dual")),
    ("sdar-8b", dict(gen_length=128, block_length=4, steps=4, threshold=0.85, cache="block")),
    ("sdar-30b-a3b", dict(gen_length=128, block_length=4, steps=4, threshold=0.85, cache="block")),
    ("fast-dllm-v2-7b", dict(gen_length=128, block_length=32, sub_block_length=8, threshold=0.9, cache="block")),
]


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("name,knobs", FAMILY_DECODERS, ids=[n for n, _ in FAMILY_DECODERS])
def test_family_decoders_export(name, knobs, platform):
    cfg = preset(name)
    r = export_generate(cfg, platform, batch=1, prompt_len=64, sampling=SamplingParams(**knobs),
                        model=abstract_model(cfg, platform))
    _check(r, name, cfg)


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("name", MODELS)
def test_continuous_batching_programs_export(name, platform):
    """The server's continuous-batching programs (decoding/segments.py) at full shapes, 4 slots: the
    rows' init (block diffusion: the prefill), a loop segment, and (block diffusion) the prefill
    over cached prompt K/V of the prefix cache."""
    from dinfer_jax.aot import export_segment_programs
    cfg = preset(name)
    block = cfg.attention_mask == "block_causal"
    sp = SamplingParams(gen_length=128, block_length=cfg.block_size or 64, cache="block" if block else "dual")
    out = export_segment_programs(cfg, platform, batch=4, prompt_len=64, sampling=sp, model=_model(name, platform),
                                  prefix_width=cfg.block_size if block else None)
    assert set(out) == ({"init", "segment", "init_prefix"} if block else {"init", "segment"})
    for what, r in out.items():
        assert r.batch == 4 and r.canvas_length >= 64 + 128
        if what == "init" and not block:  # a full-attention row's init runs no forward
            assert r.n_pallas == 0 and r.n_mosaic == r.n_triton == 0
            continue
        _check(r, f"{name} {what}", cfg)


@pytest.mark.parametrize("name", MODELS)
def test_long_canvas_exports_for_tpu(name):
    cfg = preset(name)
    sp = SamplingParams(gen_length=128, block_length=64, cache="dual")
    prompt = cfg.max_position_embeddings - 128
    r = export_generate(cfg, "tpu", batch=1, prompt_len=prompt, sampling=sp, model=_model(name, "tpu"))
    assert r.canvas_length >= cfg.max_position_embeddings
    _check(r, name, cfg)


def test_cpu_target_interprets_and_the_check_sees_it():
    """Negative control: for a CPU target the Pallas kernels are interpreted, and the report says so
    (so the n_interpreted == 0 assertions above can fail)."""
    cfg = preset("tiny")
    r = export_generate(cfg, "cpu", batch=1, prompt_len=8, sampling=SamplingParams(gen_length=16, block_length=8),
                        dtype=jnp.float32, attention_impl="pallas", moe_impl="pallas")
    assert r.n_pallas >= 2 and r.n_interpreted == r.n_pallas and r.n_mosaic == 0 and r.n_triton == 0


def test_model_platform_defaults_and_errors():
    import jax
    import numpy as np

    from dinfer_jax.model import Model
    from dinfer_jax.models import init_params
    from dinfer_jax.kernels import expert_impl as resolve_impl
    cfg = preset("tiny")
    params = init_params(cfg)
    assert Model(cfg, params).target_platform == jax.devices()[0].platform  # where the params live
    m = Model(cfg, params, platform="tpu")
    assert m.module.kernels.platform == "tpu" and m.with_mesh(None).platform == "tpu"
    assert [resolve_impl("auto", p) for p in ("tpu", "cuda", "cpu")] == ["pallas", "ragged", "tiled"]
    with pytest.raises(ValueError, match="export platform 'metal' is not one of"):
        export_generate(cfg, "metal")
    with pytest.raises(ValueError, match="model targets 'tpu', not 'cuda'"):
        export_generate(cfg, "cuda", model=abstract_model(cfg, "tpu"))
    assert np.asarray(Model(cfg, params, platform="cpu").logits(np.arange(8) % 100)).shape == (8, cfg.vocab_size)


def test_diffusion_gemma_generate_lowers_for_cuda_at_26b_a4b_shapes():
    """DiffusionGemma-26B-A4B's whole generate program (encoder prefill, canvases, denoising steps,
    re-encoding: one jitted while_loop) exported for CUDA from abstract bf16 params of the preset's
    25.25 B parameters: no host callback, XLA's own ops (no custom call: attention and the
    ragged-dot experts are XLA ops there). Measured here: ~15 s, a 60 MB module."""
    import re

    import numpy as np

    from dinfer_jax.families import diffusion_gemma as dg
    from dinfer_jax.families.diffusion_gemma_plan import export_generate
    cfg, canvas = dg.config_from_hf(dg.PRESETS["diffusion-gemma-26b-a4b"])
    exp = export_generate(cfg, canvas, "cuda", batch=1, prompt_len=128, max_new_tokens=2 * canvas)
    assert exp.platforms == ("cuda",)
    text = exp.mlir_module()
    assert "stablehlo.while" in text
    assert set(re.findall(r'call_target_name = "([^"]+)"', text)) <= {"Sharding"}  # no callback, no kernel
    assert 25.0e9 < sum(int(np.prod(a.shape)) for a in exp.in_avals) < 25.6e9  # params (+ the small inputs)
