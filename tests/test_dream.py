"""Dream-7B / DiffuCoder (`DreamModel`): config, weights, logits vs transformers' Qwen2, and Dream's
sampler (strategy "dream") vs a host-loop reference written from the facts (tests/dream_reference.py).

Parity: a tiny random Qwen2ForCausalLM (biases included) is written as a real HF folder with a
DreamModel config.json and loaded through the converter; the reference runs eager attention with
an explicit bidirectional 4-D mask and Dream's pad handling (positions cumsum(keep) - 1). fp32,
max|diff| <= 1e-4 * max|ref| and identical argmax.
"""
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest


from dinfer_jax import families  # noqa: E402
from dinfer_jax.families import from_hf_dict, preset, to_hf_dict  # noqa: E402
from dinfer_jax.decoding import strategies as st  # noqa: E402
from dinfer_jax.engine import InvalidParam, SamplingParams, generate  # noqa: E402
from knobs_helper import row_knobs  # noqa: E402

CFG = preset("tiny-dream")
REL_TOL = 1e-4


def _need_torch():
    pytest.importorskip("transformers")
    return pytest.importorskip("torch")


@pytest.fixture(scope="module")
def dream_ref():
    _need_torch()
    from hf_reference import qwen2_reference
    return qwen2_reference(CFG, seed=3)


@pytest.fixture(scope="module")
def dream_hf_dir(tmp_path_factory, dream_ref):
    from hf_reference import write_hf_folder
    d = str(tmp_path_factory.mktemp("dream_hf"))
    sd = {k: v.clone() for k, v in dream_ref.state_dict().items()}
    write_hf_folder(d, CFG, sd)
    return d


@pytest.fixture(scope="module")
def dream_model(dream_hf_dir):
    from dinfer_jax import load_model
    return load_model(dream_hf_dir)


# ------------------------------------------------------------------------------ config and weights


@pytest.mark.smoke
def test_config_family_and_presets():
    hf = to_hf_dict(CFG)
    assert hf["architectures"] == ["DreamModel"] and hf["model_type"] == "Dream"
    assert from_hf_dict(hf) == CFG and CFG.qkv_bias and CFG.logit_shift == 1
    big = preset("dream-7b")
    assert from_hf_dict(to_hf_dict(big)) == big
    assert (big.mask_token_id, big.eos_token_id, big.pad_token_id) == (151666, 151643, 151643)
    assert abs(big.num_params - 7.6156e9) < 1e6  # Qwen2.5-7B with untied head
    # The §13.1 config.json (DiffuCoder) without any special id falls back to the family's ids.
    real = dict(architectures=["DreamModel"], model_type="Dream", hidden_size=3584, num_hidden_layers=28,
                num_attention_heads=28, num_key_value_heads=4, intermediate_size=18944, hidden_act="silu",
                vocab_size=152064, rms_norm_eps=1e-6, rope_theta=1e6, rope_scaling=None, tie_word_embeddings=False,
                max_position_embeddings=131072, use_sliding_window=False, use_mrope=False)
    assert from_hf_dict(real) == big
    from dinfer_jax.config import ConfigError
    with pytest.raises(ConfigError, match="use_sliding_window"):
        from_hf_dict({**real, "use_sliding_window": True})
    fam = families.get("dream")
    from dinfer_jax.chat import render
    text = render(fam.chat_template, [{"role": "user", "content": "hi"}])
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    d = SamplingParams.for_model(CFG, gen_length=32).validate()
    assert (d.strategy, d.alg, d.cache, d.block_length) == ("dream", "entropy", "none", 32)


def test_logits_match_qwen2_with_left_padding(dream_ref, dream_model, rng):
    from hf_reference import dream_logits
    ids = rng.randint(0, CFG.vocab_size, (2, 14))
    keep = np.ones_like(ids, bool)
    keep[1, :4] = False  # left padding, Dream style
    ref = dream_logits(dream_ref, ids, keep)
    pos = np.maximum(np.cumsum(keep, -1) - 1, 0)
    ours, _ = jax.jit(lambda p, t, q, m: dream_model.module.apply({"params": p}, tokens_BS=t, positions_BS=q,
                                                                  key_mask_BL=m))(
        dream_model.params, jnp.asarray(ids, jnp.int32), jnp.asarray(pos, jnp.int32), jnp.asarray(keep))
    ours = np.asarray(ours)
    rels = []
    for got, want in ((ours[0], ref[0]), (ours[1, 4:], ref[1, 4:])):  # padded query rows are don't-care
        rels.append(np.abs(got - want).max() / np.abs(want).max())
        np.testing.assert_array_equal(got.argmax(-1), want.argmax(-1))
    print(f"dream vs Qwen2 max rel logit diff: {max(rels):.2e}")
    assert max(rels) <= REL_TOL
    # the biases matter (the comparison would fail without them)
    no_bias = jax.tree_util.tree_map(lambda a: a, dream_model.params)
    no_bias["layers"]["attn"] = {k: (jnp.zeros_like(v) if k.endswith("_bias") else v)
                                 for k, v in no_bias["layers"]["attn"].items()}
    assert np.abs(dream_model.module.apply({"params": no_bias}, jnp.asarray(ids[:1]))[0][0] - ref[0]).max() > 1e-2


def test_converter_round_trip_bit_exact(tmp_path, dream_ref, dream_hf_dir):
    from hf_reference import assert_bit_exact, convert_export_round_trip
    back, got = convert_export_round_trip(dream_hf_dir, tmp_path)
    assert_bit_exact(got, dream_ref.state_dict())
    assert any(k.endswith("q_proj.bias") for k in got)
    assert json.load(open(os.path.join(back, "config.json"))) == json.load(open(os.path.join(dream_hf_dir, "config.json")))


# ----------------------------------------------------------------------------------------- sampler


def test_schedule_matches_torch_linspace():
    """k = int(n * (1 - s/t)) with t = torch.linspace(1, eps, steps + 1) in float32: the same k on
    this grid; t itself within one float32 ulp (torch's CPU kernel rounds its vectorised lanes
    differently from its scalar formula, which ours follows; see strategies.torch_linspace_f32)."""
    torch = _need_torch()
    for steps, eps in ((8, 1e-3), (32, 1e-3), (512, 1e-3), (7, 0.25), (3, 0.0)):
        ts = torch.linspace(1, eps, steps + 1)
        i = np.arange(steps)
        for n in (1, 5, 32, 100, 511):
            frac, k = st.dream_schedule(jnp.full((steps,), eps, jnp.float32), steps, jnp.asarray(i, jnp.int32),
                                        jnp.full((steps,), n, jnp.int32))
            want = [int(torch.tensor(float(n)) * (1 - ts[j + 1] / ts[j])) if j < steps - 1 else n for j in i]
            assert np.asarray(k).tolist() == want, (steps, eps, n)
            np.testing.assert_allclose(np.asarray(frac)[:-1], (1 - ts[1:steps] / ts[:steps - 1]).numpy(), rtol=0, atol=2.5e-7)


PROMPTS = [[5, 9, 17, 33, 2, 71, 8], [40, 41, 3]]


def _gen(model, **kw):
    base = dict(gen_length=16, block_length=16, strategy="dream", steps=8, cache="none")
    return generate(model, PROMPTS, SamplingParams(**{**base, **kw}))


ALGS = ["maskgit_plus", "topk_margin", "entropy"]


@pytest.mark.parametrize("alg,cache,block", [(a, "none", 16) for a in ALGS] + [(a, "dual", 8) for a in ALGS]
                         + [("maskgit_plus", "prefix", 8), ("entropy", "vicinity", 8)])
def test_sampler_matches_reference(dream_model, alg, cache, block):
    """Token for token vs the host-loop reference at temperature 0, each prompt alone (batch 1)
    vs both in one left-padded batch (rows are independent). Cached runs use two blocks: dual's
    window extended one position left, prefix's window from block start - 1, vicinity's logits
    slice one row left, each over the cache refreshed at block entry."""
    from dream_reference import reference_dream
    p = SamplingParams(gen_length=16, block_length=block, strategy="dream", alg=alg, steps=8, cache=cache,
                       early_stop=False, prefix_look=3, after_look=2, warmup_steps=1)
    r = generate(dream_model, PROMPTS, p)
    for b, prompt in enumerate(PROMPTS):
        assert r.raw_ids[b].tolist() == reference_dream(dream_model, prompt, p), (alg, cache, b)
    assert r.nfe == [8, 8]
    if alg == "entropy" and cache == "none":  # the filters are traced knobs: same program
        p2 = SamplingParams(gen_length=16, block_length=16, strategy="dream", alg=alg, steps=8, cache=cache,
                            early_stop=False, top_p=0.5, top_k=5)
        r2 = generate(dream_model, PROMPTS, p2)
        for b, prompt in enumerate(PROMPTS):
            assert r2.raw_ids[b].tolist() == reference_dream(dream_model, prompt, p2), ("filters", b)


def test_origin_matches_reference_with_our_rng(dream_model):
    from dream_reference import reference_dream
    p = SamplingParams(gen_length=16, block_length=16, strategy="dream", alg="origin", steps=8, cache="none",
                       seed=11)
    r = generate(dream_model, PROMPTS[:1], p)
    assert r.raw_ids[0].tolist() == reference_dream(dream_model, PROMPTS[0], p)
    r2 = generate(dream_model, PROMPTS[:1], SamplingParams(**{**p.__dict__, "seed": 12}))
    assert r2.raw_ids[0].tolist() != r.raw_ids[0].tolist()  # the reveal order is random


def test_unshifted_logits_fail_the_reference(dream_model):
    """The same weights decoded WITHOUT the shift differ from the reference: the equality tests
    above would catch a loop that ignores ModelConfig.logit_shift."""
    from dream_reference import reference_dream
    from dinfer_jax.model import Model
    p = SamplingParams(gen_length=16, block_length=16, strategy="dream", alg="maskgit_plus", steps=8, cache="none")
    unshifted = Model(dream_model.config.replace(logit_shift=0), dream_model.params)
    got = generate(unshifted, PROMPTS[:1], p).raw_ids[0].tolist()
    assert got != reference_dream(dream_model, PROMPTS[0], p)


@pytest.mark.smoke
def test_random_draws_statistics():
    """alg_temp > 0: k positions drawn without replacement from softmax(conf / alg_temp) (k = 1:
    first-pick frequencies); temperature > 0: tokens drawn from the filtered softmax."""
    R, S, V, M = 4000, 4, 6, 5
    rng = np.random.RandomState(0)
    logits = np.tile(rng.randn(1, S, V).astype(np.float32) * 2, (R, 1, 1))
    x = np.full((R, S), M, np.int32)
    x[:, 3] = 1  # not masked: never picked
    knobs = row_knobs(R, temperature=np.zeros(R, np.float32), top_p=np.ones(R, np.float32),
                      top_k=np.zeros(R, np.float32), alg_temp=np.full(R, 0.05, np.float32))
    keys = jax.vmap(jax.random.key)(jnp.arange(R, dtype=jnp.uint32))
    f = jax.jit(lambda l, x, kn, keys, k: st.dream_decide("maskgit_plus", l, x, M, kn, keys_B=keys,
                                                          frac_B=jnp.zeros(R), k_B=k))
    cand, tr = f(logits, x, knobs, keys, jnp.ones(R, jnp.int32))
    tr = np.asarray(tr)
    assert (tr.sum(1) == 1).all() and not tr[:, 3].any()
    p = np.exp(logits[0] - logits[0].max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    conf = p.max(-1)[:3]
    w = np.exp((conf - conf.max()) / 0.05)
    w /= w.sum()
    np.testing.assert_allclose(tr[:, :3].mean(0), w, atol=0.03)
    assert (np.asarray(cand) == p.argmax(-1)).all()  # temperature 0: argmax candidates
    # temperature 1 with top_k 2: tokens from the renormalised top-2 distribution
    knobs2 = knobs.replace(temperature=jnp.ones(R, jnp.float32), top_k=jnp.full(R, 2, jnp.float32),
                           alg_temp=jnp.zeros(R, jnp.float32))
    cand2, _ = f(logits, x, knobs2, keys, jnp.ones(R, jnp.int32))
    cand2 = np.asarray(cand2)[:, 0]
    top2 = np.argsort(-logits[0, 0])[:2]
    q = p[0, top2] / p[0, top2].sum()
    assert set(np.unique(cand2)) <= set(top2.tolist())
    np.testing.assert_allclose([(cand2 == t).mean() for t in top2], q, atol=0.03)


def test_bad_inputs_name_the_field():
    cases = [
        (dict(strategy="dream", alg="greedy"), "alg"),
        (dict(strategy="dream", alg_temp=-0.1), "alg_temp"),
        (dict(strategy="dream", eps=1.0), "eps"),
        (dict(strategy="dream", eps=-1e-3), "eps"),
        (dict(strategy="dream", eps=float("nan")), "eps"),
        (dict(strategy="threshold", alg="entropy"), "alg"),
        (dict(strategy="threshold", alg_temp=0.5), "alg_temp"),
        (dict(strategy="dream", gen_length=16, block_length=8, steps=5), "steps"),
        (dict(strategy="dream", top_p=0.0), "top_p"),
    ]
    for kw, field in cases:
        with pytest.raises(InvalidParam) as e:
            SamplingParams(**{"gen_length": 16, "block_length": 16, **kw}).validate()
        assert e.value.field == field and field in str(e.value), (kw, e.value.field, str(e.value))
    # smoothing is refused for a shifted model (at spec time, with the model's shift)
    with pytest.raises(InvalidParam, match="shifted") as e:
        SamplingParams(gen_length=16, block_length=16, strategy="dream", smoothing=True, cache="none").spec_for(CFG)
    assert e.value.field == "smoothing"


def test_cli_picks_dreams_sampler_and_checks_its_flags(dream_hf_dir, capsys):
    """Without --strategy a Dream folder decodes with the family's own sampler (dream, entropy,
    cache none, one block over the whole canvas); explicit flags win; bad values name their flag."""
    from dinfer_jax import cli
    parser = cli.build_parser()

    def params(*extra):
        a = parser.parse_args(["generate", "--model", dream_hf_dir, "--prompt-ids", "5,9", "--gen-length", "32",
                               *extra])
        return cli._sampling_params(a, dream_hf_dir)

    p = params()
    assert (p.strategy, p.alg, p.cache, p.block_length, p.gen_length, p.eps) == ("dream", "entropy", "none", 32, 32, 1e-3)
    p = params("--alg", "topk_margin", "--alg-temp", "0.5", "--cache", "dual", "--block-length", "16", "--steps", "8")
    assert (p.alg, p.alg_temp, p.cache, p.block_length, p.steps) == ("topk_margin", 0.5, "dual", 16, 8)
    assert params("--strategy", "threshold").strategy == "threshold"
    for flags, name in ((["--eps", "1.5"], "--eps"), (["--alg-temp", "-1"], "--alg-temp"),
                        (["--strategy", "threshold", "--alg", "entropy"], "--alg")):
        with pytest.raises(SystemExit) as e:
            cli.main(["generate", "--model", dream_hf_dir, "--prompt-ids", "5,9", "--gen-length", "32", *flags])
        assert e.value.code == 2 and f"error: {name}:" in capsys.readouterr().err, flags


@pytest.mark.smoke
def test_rows_decode_alone_as_in_a_batch():
    """Project invariant with Dream's sampler (per-row k): a prompt decodes identically alone and
    left-padded in a batch; dual cache with two blocks (the shifted window path). No torch."""
    from demo_helpers import peaky_random_params
    from dinfer_jax.model import Model
    model = Model(CFG, peaky_random_params(CFG))  # peaky: no near-ties for float noise to flip
    p = SamplingParams(gen_length=16, block_length=8, strategy="dream", alg="entropy", steps=8, cache="dual",
                       early_stop=False)
    both = generate(model, PROMPTS, p)
    alone = generate(model, PROMPTS[1:], p)
    assert both.raw_ids[1].tolist() == alone.raw_ids[0].tolist()
    assert both.nfe == [8, 8] and (both.raw_ids != CFG.mask_token_id).any()


def test_server_body_takes_dreams_fields():
    """The OpenAI-compatible body accepts strategy "dream" with alg / alg_temp / eps; a bad value
    is an InvalidParam naming the field (the server answers 400 with it). No compile."""
    pytest.importorskip("fastapi")
    from dinfer_jax.serving.http import CommonFields
    from dinfer_jax.serving.scheduler import derive_params
    d = SamplingParams.for_model(CFG, gen_length=32)
    body = CommonFields(strategy="dream", alg="topk_margin", alg_temp=0.2, eps=0.01, max_tokens=16)
    from dinfer_jax.serving.http import DinferFields
    upd = {k: getattr(body, k) for k in DinferFields.model_fields if getattr(body, k) is not None}
    p = derive_params(d, upd, 16)
    assert (p.strategy, p.alg, p.alg_temp, p.eps, p.gen_length, p.block_length) == ("dream", "topk_margin", 0.2, 0.01,
                                                                                    16, 16)
    with pytest.raises(InvalidParam) as e:
        derive_params(d, {"alg": "beam"}, 16)
    assert e.value.field == "alg"
