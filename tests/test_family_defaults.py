"""Family defaults everywhere (SamplingParams.for_model): a model folder with no flags decodes with
its family's authors' own generate() defaults, then its generation_config.json, then explicit
values. The parity tests decode tiny random folders (dinfer-jax checkpoints written here) with
params=None / no CLI flags and compare with the host-loop references of the authors' generate()
(tests/block_decoding_reference.py: LLaDA2.0 / 2.1; test_sdar.reference_sdar_generate;
test_fast_dllm_v2._reference), called with the authors' defaults written out below
(docs/decoding_defaults.md), not read from our family tables."""
import json
import os
import subprocess
import sys
import types
import warnings

import numpy as np
import pytest
from block_decoding_reference import reference_block_generate

from dinfer_jax import checkpoint, engine, load_model
from dinfer_jax.config import ConfigError
from dinfer_jax.families import preset, to_hf_dict
from dinfer_jax.engine import FamilyWarning, SamplingParams, generate

PROMPTS = [[5, 17, 3, 99, 42], [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 2], [60, 61, 62]]
G = 128  # SamplingParams' default gen_length: no folder here names one

# The authors' generate() defaults (docs/decoding_defaults.md), per family, at temperature 0.
LLADA20 = dict(steps=32, threshold=0.95, num_to_transfer=1, editing_threshold=None, max_post_steps=16)
SDAR = dict(steps=4, threshold=0.85)  # generate.py: block_length 4, denoising_steps 4, dynamic 0.85
FAST_DLLM_V2 = dict(small_block=8, threshold=0.9)  # generate(): block_size 32, small_block_size 8


def _folder(tmp_path_factory, name, seed, generation_config=None, head_scale=1.0):
    """A tiny random dinfer-jax checkpoint of preset `name` (untied LM head; peaky weights, the LM
    head scaled by head_scale, so that the authors' high thresholds commit several tokens in some
    steps; the mask id's LM-head row zero so that it is (almost) never predicted, as in trained
    models), optionally with a generation_config.json."""
    from demo_helpers import peaky_random_params
    cfg = preset(name).replace(tie_word_embeddings=False)
    params = peaky_random_params(cfg, seed=seed)
    head = np.asarray(params["lm_head"]["unembedding"]).copy()
    head *= head_scale
    head[cfg.mask_token_id] = 0.0
    params["lm_head"]["unembedding"] = head
    d = str(tmp_path_factory.mktemp(name) / "model")
    checkpoint.save_params(d, params, to_hf_dict(cfg))
    if generation_config is not None:
        with open(os.path.join(d, "generation_config.json"), "w") as f:
            json.dump(generation_config, f)
    return d


def _ref_params(block, gen_length=G, **kw):
    return types.SimpleNamespace(block_length=block, gen_length=gen_length, early_stop=True, **kw)


def _cut(want, eos):
    """The block reference's output (cut after the first EOS, inclusive) as ours (cut before it)."""
    return want[:-1] if want and want[-1] == eos else want


def _ours(model, want_nfe, r, i, want):
    assert r.token_ids[i] == _cut(want, model.config.eos_token_id), f"prompt {i}"
    assert r.nfe[i] == want_nfe, f"prompt {i}: {r.nfe[i]} forwards, reference {want_nfe}"


def _several_per_step(r):
    assert any(len(t) > n for t, n in zip(r.token_ids, r.nfe)), (
        f"no step committed several tokens (nfe {r.nfe}): the threshold was not exercised")


# ------------------------------------------------------------------------------------ resolution rules
@pytest.mark.smoke
def test_each_family_resolves_to_its_documented_defaults():
    f = lambda name, **kw: SamplingParams.for_model(preset(name), **kw).validate()  # noqa: E731
    # LLaDA / LLaDA-MoE: dInfer's defaults, as before (SamplingParams()).
    assert f("tiny") == SamplingParams() and f("tiny-dense") == SamplingParams()
    l2 = f("tiny-llada2")
    assert (l2.cache, l2.strategy, l2.block_length, l2.steps, l2.threshold, l2.editing_threshold) == (
        "block", "threshold", 8, 32, 0.95, None)  # block = the model's attention block (config.json)
    sd = f("tiny-sdar")
    assert (sd.cache, sd.block_length, sd.steps, sd.threshold) == ("block", 4, 4, 0.85)
    fd = f("tiny-fast-dllm-v2")
    assert (fd.cache, fd.block_length, fd.sub_block_length, fd.threshold, fd.steps) == ("block", 8, 8, 0.9, None)
    dr = f("tiny-dream", gen_length=32)
    assert (dr.strategy, dr.alg, dr.cache, dr.block_length) == ("dream", "entropy", "none", 32)  # whole canvas
    # Explicit values win, and take the defaults that belong with them along:
    e = f("tiny-llada2", editing_threshold=0.5)  # LLaDA2.1's rule has no steps schedule
    assert e.editing_threshold == 0.5 and e.steps is None
    assert f("tiny-llada2", steps=4).steps == 4
    with pytest.raises(engine.InvalidParam, match="steps"):
        f("tiny-llada2", steps=4, editing_threshold=0.5)  # both explicit: still refused
    assert f("tiny-dream", strategy="threshold").alg is None  # Dream's alg goes with its sampler
    assert f("tiny", gen_length=16).block_length == 16  # a full-canvas block never exceeds gen_length


def test_generation_config_is_read_and_bad_values_name_the_file(tmp_path):
    cfg = preset("tiny-llada2")
    d = str(tmp_path)
    with open(os.path.join(d, "generation_config.json"), "w") as f:
        json.dump({"threshold": 0.7, "editing_threshold": 0.5, "max_post_steps": 8, "top_p": None,
                   "eos_token_id": 1, "alg": "origin"}, f)  # alg: not a LLaDA2 generate() argument
    sp = SamplingParams.for_model(cfg, d).validate()
    assert (sp.threshold, sp.editing_threshold, sp.max_post_steps, sp.steps, sp.cache, sp.alg) == (
        0.7, 0.5, 8, None, "block", None)
    assert SamplingParams.for_model(cfg, d, threshold=0.9).threshold == 0.9  # explicit over the folder
    with open(os.path.join(d, "generation_config.json"), "w") as f:
        json.dump({"threshold": "high"}, f)
    with pytest.raises(ConfigError, match=r"generation_config.json: threshold='high' must be a number"):
        SamplingParams.for_model(cfg, d)
    with open(os.path.join(d, "generation_config.json"), "w") as f:
        f.write("{not json")
    with pytest.raises(ConfigError, match="generation_config.json: not readable JSON"):
        SamplingParams.for_model(cfg, d)


def test_full_canvas_cache_on_a_block_causal_model_warns_once_saying_what_changes():
    engine._WARNED.clear()
    cfg = preset("tiny-sdar")
    with pytest.warns(FamilyWarning, match=r"cache='dual' on a block-causal sdar model: .*not with block diffusion"):
        SamplingParams.for_model(cfg, cache="dual")
    with warnings.catch_warnings():
        warnings.simplefilter("error", FamilyWarning)
        SamplingParams.for_model(cfg, cache="dual")  # once
        SamplingParams.for_model(cfg)  # its own defaults: no warning
        SamplingParams.for_model(preset("tiny"), cache="none")  # a bidirectional model: nothing to say


# ------------------------------------------------------------------------------------ parity, no flags
@pytest.fixture(scope="module")
def llada2_dir(tmp_path_factory):
    return _folder(tmp_path_factory, "tiny-llada2", seed=11, head_scale=6.0)


def test_llada2_0_folder_no_params_equals_its_generate_defaults(llada2_dir):
    model = load_model(llada2_dir)
    r = generate(model, PROMPTS[:2])  # params=None: the folder's defaults
    B = model.config.block_size
    for i, prompt in enumerate(PROMPTS[:2]):
        want, nfe, _ = reference_block_generate(model, prompt, _ref_params(B, **LLADA20))
        _ours(model, nfe, r, i, want)
    _several_per_step(r)


def test_llada2_1_folder_takes_its_generation_config(tmp_path_factory):
    """A folder whose generation_config.json names editing settings (LLaDA2.1 / 2.2) decodes with
    LLaDA2.1's sampler and those values (the 2.1 generate(): no steps schedule, 1 token a step at
    least), with no flags."""
    gc = {"threshold": 0.3, "editing_threshold": 0.3, "max_post_steps": 3}
    d = _folder(tmp_path_factory, "tiny-llada2", seed=11, generation_config=gc)
    model = load_model(d)
    r = generate(model, PROMPTS)
    B = model.config.block_size
    total = 0
    for i, prompt in enumerate(PROMPTS):
        want, nfe, edits = reference_block_generate(model, prompt, _ref_params(
            B, steps=None, num_to_transfer=1, **gc))
        _ours(model, nfe, r, i, want)
        assert r.edits[i] == edits
        total += edits
    assert total > 0, "no token was edited: the editing path was not exercised"


def test_sdar_folder_no_params_equals_its_generate_defaults(tmp_path_factory):
    from test_sdar import reference_sdar_generate
    # gen_length from the folder's own "dinfer_jax" entry (still no flags): a shorter reference run
    model = load_model(_folder(tmp_path_factory, "tiny-sdar", seed=5, head_scale=6.0,
                               generation_config={"dinfer_jax": {"gen_length": 32}}))
    r = generate(model, PROMPTS)
    for i, prompt in enumerate(PROMPTS):
        want, nfe, _, _ = reference_sdar_generate(model, prompt, 4, 32, SDAR["steps"], SDAR["threshold"])
        assert r.token_ids[i] == want, f"prompt {i}"
        assert r.nfe[i] == nfe, f"prompt {i}: {r.nfe[i]} forwards, reference {nfe}"
    _several_per_step(r)


def test_fast_dllm_v2_folder_no_params_equals_its_generate_defaults(tmp_path_factory):
    from test_fast_dllm_v2 import _reference
    model = load_model(_folder(tmp_path_factory, "tiny-fast-dllm-v2", seed=7, head_scale=6.0,
                               generation_config={"dinfer_jax": {"gen_length": 64}}))  # 2 blocks: a shorter run
    r = generate(model, PROMPTS)
    B = model.config.block_size
    for i, prompt in enumerate(PROMPTS):
        want, nfe, _ = _reference(model, prompt, B, FAST_DLLM_V2["small_block"], 64, FAST_DLLM_V2["threshold"])
        assert r.token_ids[i] == want, f"prompt {i}"
        assert r.nfe[i] == nfe, f"prompt {i}: {r.nfe[i]} forwards, reference {nfe}"
    _several_per_step(r)


# ------------------------------------------------------------------------------------ CLI
CLI = [sys.executable, "-m", "dinfer_jax.cli"]


def _cli(args):
    return subprocess.run(CLI + args, capture_output=True, text=True, timeout=600)


def test_cli_generate_block_folder_without_flags_decodes_in_block_mode(llada2_dir):
    model = load_model(llada2_dir)
    prompt = PROMPTS[0]
    want, nfe, _ = reference_block_generate(model, prompt, _ref_params(model.config.block_size, **LLADA20))
    r = _cli(["generate", "--model", llada2_dir, "--prompt-ids", ",".join(map(str, prompt)), "--json"])
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["token_ids"] == _cut(want, model.config.eos_token_id) and out["nfe"] == nfe
    assert "warning" not in r.stderr
    # the refusal: --editing-threshold alone now applies (block diffusion is the default)
    p = _ref_params(model.config.block_size, steps=None, threshold=0.95, num_to_transfer=1, editing_threshold=0.3,
                    max_post_steps=16)
    want, nfe, _ = reference_block_generate(model, prompt, p)
    r = _cli(["generate", "--model", llada2_dir, "--prompt-ids", ",".join(map(str, prompt)),
              "--editing-threshold", "0.3", "--json"])
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["token_ids"] == _cut(want, model.config.eos_token_id) and out["nfe"] == nfe


def test_cli_info_prints_the_defaults_and_a_contradicting_flag_warns(llada2_dir):
    r = _cli(["info", llada2_dir])
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)["decoding_defaults"]
    assert d["cache"] == "block" and d["threshold"] == 0.95 and d["steps"] == 32 and d["block_length"] == 8
    r = _cli(["generate", "--model", llada2_dir, "--prompt-ids", "5,6", "--cache", "dual", "--gen-length", "8",
              "--block-length", "8", "--json"])
    assert r.returncode == 0, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("dinfer-jax: warning: cache='dual'")]
    assert len(lines) == 1 and "block diffusion" in lines[0], r.stderr


def test_serve_defaults_are_the_folder_defaults(llada2_dir):
    from dinfer_jax import cli
    a = cli.build_parser().parse_args(["serve", "--model", llada2_dir])
    assert cli._serve_defaults(a, llada2_dir) == SamplingParams.for_model(load_model(llada2_dir).config, llada2_dir)
    a = cli.build_parser().parse_args(["serve", "--model", llada2_dir, "--default-max-tokens", "64", "--threshold",
                                       "0.5"])
    sp = cli._serve_defaults(a, llada2_dir)
    assert (sp.cache, sp.gen_length, sp.threshold, sp.steps) == ("block", 64, 0.5, 32)
