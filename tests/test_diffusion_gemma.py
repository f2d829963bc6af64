"""DiffusionGemma against transformers' own classes (transformers >= 5.x ships the reference) on a
tiny random model whose every weight, norm, scalar and router scale is random (so none of them can
be silently ignored): the config reader, the weight mapping, the encoder + decoder logits with and
without self-conditioning (fp32, max|diff| <= 1e-5 * max|ref|: accumulation-order noise is ~1e-7
relative here), and whole generations token for token with the reference's random draws replayed
into our jitted loop (recorded from torch.randint / torch.multinomial during its generate()).
"""
import json
import os

import numpy as np
import pytest

pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
import torch  # noqa: E402

try:
    from transformers import DiffusionGemmaConfig, DiffusionGemmaForBlockDiffusion, DiffusionGemmaTextConfig
    from transformers.models.diffusion_gemma import generation_diffusion_gemma as ref_generation
    from transformers.models.gemma4 import Gemma4VisionConfig
except ImportError:  # an older transformers without the reference
    pytest.skip("transformers has no DiffusionGemma", allow_module_level=True)
from transformers import DynamicCache  # noqa: E402

from dinfer_jax.decoding import entropy_bound as eb  # noqa: E402
from dinfer_jax.families import diffusion_gemma as dg  # noqa: E402

REL_TOL = 1e-5
C = 4  # canvas length
W = 8  # sliding window


@pytest.fixture(scope="module")
def ref_model():
    tc = DiffusionGemmaTextConfig(
        vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, global_head_dim=16, num_global_key_value_heads=1, num_experts=4,
        top_k_experts=2, moe_intermediate_size=12, sliding_window=W,
        layer_types=["sliding_attention", "full_attention"])
    vc = Gemma4VisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                            num_key_value_heads=2, head_dim=8)
    torch.manual_seed(0)
    model = DiffusionGemmaForBlockDiffusion(DiffusionGemmaConfig(text_config=tc, vision_config=vc,
                                                                 canvas_length=C)).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "vision" in name:
                continue
            base = 1.0 if (name.endswith("norm.weight") or "scale" in name) else 0.0
            p.copy_(base + 0.05 * torch.randn(p.shape, generator=g))
        for name, b in model.named_buffers():
            if name.endswith("layer_scalar"):  # encoder and decoder passes: different buffers
                b.copy_(0.5 + torch.rand(b.shape, generator=g))
    return model


@pytest.fixture(scope="module")
def ours(ref_model):
    cfg, canvas = dg.config_from_hf(ref_model.config.to_dict())
    sd = {k: v.detach().numpy() for k, v in ref_model.state_dict().items()}
    return dg.DiffusionGemma(cfg, dg.params_from_hf(sd.__getitem__, cfg), canvas)


def test_config_reader(ours):
    cfg = ours.cfg
    assert ours.canvas_length == C
    assert cfg.layer_types == ("sliding_attention", "full_attention")
    assert (cfg.sliding_kv_heads, cfg.sliding_head_dim, cfg.full_kv_heads, cfg.full_head_dim) == (2, 8, 1, 16)
    assert cfg.sliding_window == W and cfg.final_logit_softcapping == 30.0
    # proportional RoPE: exponent over the full head dim, only int(0.25 * 16 / 2) = 2 of 8 frequencies rotate
    f = np.asarray(cfg.inv_freq("full_attention"))
    np.testing.assert_allclose(f[:2], [1.0, 1e6 ** (-2 / 16)], rtol=1e-6)
    assert np.all(f[2:] == 0)


def _ref_logits(model, prompt, canvas, sc=None):
    with torch.no_grad():
        out = model(input_ids=torch.as_tensor(prompt), cache=DynamicCache(config=model.config.text_config),
                    decoder_input_ids=torch.as_tensor(canvas),
                    self_conditioning_logits=None if sc is None else torch.as_tensor(sc))
    return out.logits.numpy()


@pytest.mark.parametrize("prompt_len", [5, 11])  # 11 > W: sliding layers drop keys (encoder window, decoder W-1)
def test_logits_match_reference(ref_model, ours, prompt_len):
    rng = np.random.default_rng(prompt_len)
    prompt = rng.integers(0, 96, (2, prompt_len))
    canvas = rng.integers(0, 96, (2, C))
    ref = _ref_logits(ref_model, prompt, canvas)
    got = dg.logits(ours, prompt, canvas)
    assert got.shape == ref.shape == (2, C, 96)
    assert np.max(np.abs(got - ref)) <= REL_TOL * np.max(np.abs(ref)), np.max(np.abs(got - ref))
    sc = (rng.standard_normal((2, C, 96)) * 3).astype(np.float32)  # self-conditioning on earlier logits
    ref_sc = _ref_logits(ref_model, prompt, canvas, sc)
    got_sc = ours.logits(prompt, canvas=canvas, self_conditioning=sc)  # the Model-style entry point
    assert np.max(np.abs(ref_sc - ref)) > 1e-2  # the signal matters
    assert np.max(np.abs(got_sc - ref_sc)) <= REL_TOL * np.max(np.abs(ref_sc))


def _recorded_generate(model, prompt, seed, **kw):
    """The reference's generate() with its random draws recorded -> (new ids, draws dict). Its
    entropy bound travels in sampler_config (an `entropy_bound` kwarg would be silently ignored)."""
    if "entropy_bound" in kw:
        kw = dict(kw, sampler_config=ref_generation.EntropyBoundSamplerConfig(entropy_bound=kw.pop("entropy_bound")))
    calls = []
    real_randint, real_multinomial = torch.randint, torch.multinomial

    def randint(*a, **k):
        t = real_randint(*a, **k)
        calls.append(("randint", t.clone()))
        return t

    def multinomial(*a, **k):
        t = real_multinomial(*a, **k)
        calls.append(("multinomial", t.clone()))
        return t
    torch.manual_seed(seed)
    ref_generation.torch.randint, ref_generation.torch.multinomial = randint, multinomial
    try:
        with torch.no_grad():
            out = model.generate(torch.as_tensor(prompt), **kw)
    finally:
        ref_generation.torch.randint, ref_generation.torch.multinomial = real_randint, real_multinomial
    B = prompt.shape[0]
    init, sample, renoise = [], [], []
    for i, (kind, t) in enumerate(calls):  # per canvas: init randint, then (multinomial, renoise randint) per step
        if kind == "multinomial":
            sample.append(t.reshape(B, C).numpy())
        elif i > 0 and calls[i - 1][0] == "multinomial":
            renoise.append(t.numpy())
        else:
            init.append(t.numpy())
    seq = out.sequences if hasattr(out, "sequences") else out
    return seq[:, prompt.shape[1]:].numpy(), {"init": np.stack(init), "sample": np.stack(sample),
                                                "renoise": np.stack(renoise)}


@pytest.mark.parametrize("case", [
    dict(max_new_tokens=12, max_denoising_steps=5, entropy_bound=2.0),  # every step runs (random weights: high entropy)
    dict(max_new_tokens=12, max_denoising_steps=8, entropy_bound=3.0, confidence_threshold=10.0,
         stability_threshold=1),  # confident from the start; stops only on a repeated argmax
    # stable from the start (threshold 0); rows stop on their own mean entropy (margins >= 2e-3 here):
    # first canvas row 0 on step 4, row 1 on step 5 (row 0 frozen meanwhile; the loop breaks before
    # step 6); second canvas both on step 5
    dict(max_new_tokens=8, max_denoising_steps=6, entropy_bound=1.0, confidence_threshold=4.383,
         stability_threshold=0, t_min=0.05, t_max=1.0),
])
def test_generation_replays_reference_draws(ref_model, ours, case):
    prompt = np.random.default_rng(3).integers(0, 96, (2, 6))
    ref_ids, draws = _recorded_generate(ref_model, prompt, seed=5, **case)
    if case["max_denoising_steps"] == 6:  # the early stops happened (fewer draws than 2 canvases x 6 steps)
        assert len(draws["sample"]) < 12
    got = dg.generate_with_draws(ours, prompt, draws, **case)
    np.testing.assert_array_equal(got, ref_ids)


def test_stability_rule_matches_reference():
    """eb.stable_and_confident against the reference's StableAndConfidentStoppingCriteria on argmax
    sequences that repeat for some rows (the generation parity above never sees a repeat on random weights)."""
    rng = np.random.default_rng(0)
    for threshold in (0, 1, 2):
        ref = ref_generation.StableAndConfidentStoppingCriteria(threshold, 0.5)
        history = np.full((threshold, 3, 4), -1, np.int32)
        prev = rng.integers(0, 5, (3, 4))
        for step in range(6):
            argmax = np.where(rng.random((3, 1)) < 0.6, prev, rng.integers(0, 5, (3, 4)))  # rows repeat often
            logits = rng.standard_normal((3, 4, 5)).astype(np.float32) * rng.choice([0.1, 20.0], (3, 1, 1))
            want = ref(torch.as_tensor(argmax), torch.as_tensor(logits)).numpy()
            got, history = eb.stable_and_confident(history, argmax, eb.entropy(logits), 0.5)
            np.testing.assert_array_equal(np.asarray(got), want, err_msg=f"threshold {threshold} step {step}")
            prev = argmax


def test_generation_eos_and_pad_match_reference(ref_model, ours):
    prompt = np.random.default_rng(4).integers(0, 96, (2, 6))
    case = dict(max_new_tokens=12, max_denoising_steps=4, entropy_bound=2.0)  # the program of the cases above
    plain, _ = _recorded_generate(ref_model, prompt, seed=7, **case)
    eos = int(plain[0, C + 1])  # a token row 0 commits in its second canvas: rows stop there or later
    case.update(eos_token_id=[eos, 95], pad_token_id=0)
    ref_ids, draws = _recorded_generate(ref_model, prompt, seed=7, **case)
    assert (ref_ids[0, C + 2:] == 0).all()  # padded after the EOS
    got = dg.generate_with_draws(ours, prompt, draws, **case)
    np.testing.assert_array_equal(got, ref_ids)


def test_our_rng_generation_runs_and_is_seeded(ours):
    prompt = np.arange(12).reshape(2, 6)  # the shape (and program) of the tests above
    s = dg.DiffusionGemmaSettings(max_new_tokens=12, max_denoising_steps=3)
    a, b = dg.generate(ours, prompt, s, seed=1), dg.generate(ours, prompt, s, seed=1)
    assert a.shape == (2, 12) and (a == b).all()
    assert not (dg.generate(ours, prompt, s, seed=2) == a).all()


def test_bad_input_is_named(ours):
    with pytest.raises(ValueError, match="prompt_ids"):
        dg.logits(ours, np.array([[1, 200]]), np.zeros((1, C), int))
    with pytest.raises(ValueError, match="pass canvas"):
        ours.logits(np.array([[1, 2]]))
    with pytest.raises(ValueError, match="t_min"):
        dg.DiffusionGemmaSettings(t_min=0.9, t_max=0.8)
    with pytest.raises(ValueError, match="draws"):
        dg.generate_with_draws(ours, np.arange(4)[None], {"init": np.zeros((1, 1, C))})


@pytest.fixture(scope="module")
def hf_folder(ref_model, tmp_path_factory):
    """The reference model written by save_pretrained (safetensors; tied copies dropped, the vision
    tower included) with a generation_config.json in the released checkpoint's style."""
    import json
    d = tmp_path_factory.mktemp("diffusion_gemma")
    ref_model.save_pretrained(d)
    with open(d / "generation_config.json", "w") as f:
        json.dump({"eos_token_id": [1, 50], "pad_token_id": 0, "max_new_tokens": 8, "max_denoising_steps": 3,
                   "t_min": 0.4, "t_max": 0.8, "sampler_config": {"entropy_bound": 0.5}}, f)
    return str(d)


def test_folder_loads_its_text_weights(ref_model, hf_folder):
    import jax.numpy as jnp
    from safetensors import safe_open
    names = set(safe_open(f"{hf_folder}/model.safetensors", "np").keys())
    assert any(n.startswith("model.encoder.vision_tower.") for n in names)  # present, and skipped
    assert dg.is_folder(hf_folder)
    m = dg.load(hf_folder, dtype=jnp.float32)
    rng = np.random.default_rng(9)
    prompt, canvas = rng.integers(0, 96, (2, 5)), rng.integers(0, 96, (2, C))
    ref = _ref_logits(ref_model, prompt, canvas)
    assert np.max(np.abs(dg.logits(m, prompt, canvas) - ref)) <= REL_TOL * np.max(np.abs(ref))
    s = dg.settings_from_generation_config({"eos_token_id": [1, 50], "pad_token_id": 0,
                                            "sampler_config": {"entropy_bound": 0.5}})
    assert s.eos_token_id == (1, 50) and s.entropy_bound == 0.5 and s.max_denoising_steps == 48


def test_convert_and_export_round_trip(ref_model, hf_folder, tmp_path):
    """HF folder -> `convert` -> dinfer-jax checkpoint -> `export` -> HF folder: the text tensors
    come back bit-equal under the names save_pretrained wrote; transformers loads the export into the
    reference's text weights; the checkpoint decodes the folder's logits exactly."""
    import jax.numpy as jnp
    import torch
    from safetensors import safe_open
    from converters import convert, export
    from dinfer_jax import checkpoint as ckpt
    written = convert(hf_folder, str(tmp_path / "ckpt"), progress=False)
    assert ckpt.is_checkpoint(str(tmp_path / "ckpt")) and not any("vision" in p for p in written)
    export(str(tmp_path / "ckpt"), str(tmp_path / "hf"), progress=False, max_shard_size="20KB")
    assert os.path.isfile(tmp_path / "hf" / "model.safetensors.index.json")  # sharded at 20 KB
    src = safe_open(f"{hf_folder}/model.safetensors", "np")
    index = json.load(open(tmp_path / "hf" / "model.safetensors.index.json"))["weight_map"]
    text = {n for n in src.keys() if "vision" not in n}
    assert set(index) == text
    for n, fname in index.items():
        got = safe_open(str(tmp_path / "hf" / fname), "np").get_tensor(n)
        assert got.dtype == src.get_tensor(n).dtype and np.array_equal(got, src.get_tensor(n)), n
    # the fixture's generation_config.json (copied as is) has no "_cls_name" in sampler_config, which
    # transformers' GenerationConfig reader needs; the weights are what is checked here
    os.remove(tmp_path / "hf" / "generation_config.json")
    back = type(ref_model).from_pretrained(str(tmp_path / "hf")).eval()
    ref_sd = ref_model.state_dict()
    assert all(torch.equal(v, ref_sd[k]) for k, v in back.state_dict().items() if "vision" not in k)
    rng = np.random.default_rng(4)
    prompt, canvas = rng.integers(0, 96, (2, 5)), rng.integers(0, 96, (2, C))
    from_ckpt = dg.logits(dg.load(str(tmp_path / "ckpt"), dtype=jnp.float32), prompt, canvas)
    assert np.array_equal(from_ckpt, dg.logits(dg.load(hf_folder, dtype=jnp.float32), prompt, canvas))
    with pytest.raises(ValueError, match="--quantize is not built for it"):
        convert(hf_folder, str(tmp_path / "q"), quantize="int8", progress=False)


def test_commands_without_its_loop_name_the_ones_with_it(hf_folder):
    """serve / bench / logits / eval read a registered family's config: a DiffusionGemma folder gets
    one line naming the commands that take it, not 'unknown architecture'."""
    from dinfer_jax.config import ConfigError
    from dinfer_jax.families import family_of
    with pytest.raises(ConfigError, match="DiffusionGemma model .* generate, chat, plan, convert and export take it"):
        family_of(json.load(open(f"{hf_folder}/config.json")))


def test_cli_generate_decodes_a_folder(hf_folder):
    import json
    import subprocess
    import sys
    exe = [sys.executable, "-m", "dinfer_jax.cli", "generate", "--model", hf_folder, "--prompt-ids", "3,4,5"]
    r = subprocess.run(exe + ["--json"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["canvases"] in (1, 2) and len(out["token_ids"]) <= 8  # max_new_tokens 8 from the folder
    assert not set(out["token_ids"]) & {1, 50}  # cut at the first EOS
    r = subprocess.run(exe + ["--strategy", "threshold"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 2 and "--strategy do not apply" in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_cli_generate_on_a_mesh_decodes_as_one_device(hf_folder):
    """--mesh places the params on 4 fake CPU devices (4 experts over "expert", their width over
    "model"): the same seed decodes the same tokens as one device (the expert-parallel logits equal
    one device's to a few fp32 ulps: tests/test_diffusion_gemma_mesh.py)."""
    import json
    import os
    import subprocess
    import sys
    exe = [sys.executable, "-m", "dinfer_jax.cli", "generate", "--model", hf_folder, "--prompt-ids", "3,4,5",
           "--seed", "7", "--json", "--compile-cache", "off"]
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu")
    runs = [subprocess.run(exe + extra, capture_output=True, text=True, timeout=600, env=env)
            for extra in ([], ["--mesh", "expert=2,model=2"])]
    for r in runs:
        assert r.returncode == 0, r.stderr[-3000:]
    one, mesh = (json.loads(r.stdout) for r in runs)
    assert one["token_ids"] == mesh["token_ids"] and one["canvases"] == mesh["canvases"], (one, mesh)
    assert "mesh" not in one and mesh["mesh"] == {"data": 1, "expert": 2, "model": 2}
    r = subprocess.run(exe + ["--mesh", "expert=4,model=1"], capture_output=True, text=True, timeout=600,
                       env=dict(env, XLA_FLAGS="--xla_force_host_platform_device_count=4"))
    assert r.returncode == 0, r.stderr[-3000:]  # 4 experts over 4 devices
    r = subprocess.run(exe + ["--mesh", "expert=2,model=2", "--coordinator", "h:1", "--num-processes", "2",
                              "--process-id", "0"], capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 2 and "several hosts" in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]


def test_released_preset_sizes():
    """The 26B-A4B preset's parameter counts (from shapes alone): 25.25 B total, 3.84 B active (8 of
    128 experts), consistent with the name; 5 full layers of 30 (every 6th)."""
    import jax
    from dinfer_jax.models.gemma4 import init_params
    cfg, canvas = dg.preset("diffusion-gemma-26b-a4b")
    assert canvas == 256 and cfg.layer_types.count("full_attention") == 5 and cfg.layer_types[5] == "full_attention"
    leaves = jax.tree_util.tree_leaves_with_path(jax.eval_shape(lambda: init_params(cfg, batch=1, slots=4)))
    total = sum(int(np.prod(x.shape)) for _, x in leaves)
    experts = sum(int(np.prod(x.shape)) for p, x in leaves if "experts" in jax.tree_util.keystr(p))
    assert round(total / 1e9, 2) == 25.25 and round((total - experts + experts * 8 // 128) / 1e9, 2) == 3.84


def test_left_padded_batch_matches_reference(ref_model, ours):
    """Rows of different prompt lengths, left-padded (attention_mask / prompt_mask): positions are
    shared by the rows, padding only masked, as the reference does."""
    prompt = np.random.default_rng(3).integers(2, 96, (2, 6))
    prompt[1, :2] = 0
    mask = np.ones((2, 6), bool)
    mask[1, :2] = False
    case = dict(max_new_tokens=12, max_denoising_steps=5, entropy_bound=2.0)
    ref_ids, draws = _recorded_generate(ref_model, prompt, seed=5, attention_mask=torch.as_tensor(mask.astype(np.int64)),
                                        **case)
    unpadded, _ = _recorded_generate(ref_model, prompt, seed=5, **case)
    assert (ref_ids != unpadded).any()  # the mask matters
    np.testing.assert_array_equal(dg.generate_with_draws(ours, prompt, draws, prompt_mask=mask, **case), ref_ids)


def test_cli_chat_renders_the_folders_template(hf_folder, tmp_path):
    """`chat` on a DiffusionGemma folder: its own chat template renders the conversation (history
    included), each turn is decoded by the DiffusionGemma loop; a folder without a template is a
    one-line error (no Gemma 4 template is built in)."""
    import json
    import shutil
    import subprocess
    import sys
    from dinfer_jax.checkpoint import DEMO_MODEL_DIR
    d = tmp_path / "dg"
    shutil.copytree(hf_folder, d)
    shutil.copy(f"{DEMO_MODEL_DIR}/tokenizer.json", d)  # character-level; no spaces below (their ids are >= 96)
    exe = [sys.executable, "-m", "dinfer_jax.cli", "chat", "--model", str(d), "--show-prompt", "--compile-cache", "off"]
    r = subprocess.run(exe, input="hi\n", capture_output=True, text=True, timeout=600)
    assert r.returncode == 2 and "no chat template" in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]
    with open(d / "tokenizer_config.json", "w") as f:
        json.dump({"eos_token": "<|endoftext|>", "chat_template": "{% for m in messages %}{{ m['role'][0] }}:"
                   "{{ m['content'] }};{% endfor %}{% if add_generation_prompt %}a:{% endif %}"}, f)
    r = subprocess.run(exe, input="hi\nho\n", capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    answers = r.stdout.splitlines()
    assert len(answers) == 2, r.stdout
    assert "u:hi;a:\n" in r.stderr and f"u:hi;a:{answers[0]};u:ho;a:\n" in r.stderr, r.stderr[-2000:]
