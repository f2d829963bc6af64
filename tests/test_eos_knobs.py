"""ignore_eos / min_tokens (vLLM's request extras): per-row traced knobs of one compiled program; the
EOS logit is -inf where they apply, so EOS is never chosen there and the row does not stop early."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from dinfer_jax.checkpoint import DEMO_MODEL_DIR
from dinfer_jax.families import preset
from dinfer_jax.engine import SamplingParams
from dinfer_jax.model import Model

pytestmark = pytest.mark.smoke  # no torch; also runs on the newest jax


def _check_rows(model, prompts, base, eos):
    """Rows [plain, ignore_eos, min_tokens=10] in one batch, after the plain batch of the same shape."""
    g = model.generator
    plain = g.generate(prompts, [base] * 3)
    assert eos in plain.raw_ids[0].tolist() and len(plain.token_ids[0]) < base.gen_length  # stops by itself
    n = g.compiles
    r = g.generate(prompts, [base, dataclasses.replace(base, ignore_eos=True), dataclasses.replace(base, min_tokens=10)])
    assert g.compiles == n  # traced knobs: no new program
    assert r.token_ids[0] == plain.token_ids[0]  # a row's knobs never change its neighbours
    assert eos not in r.raw_ids[1].tolist() and len(r.token_ids[1]) == base.gen_length
    assert eos not in r.raw_ids[2][:10].tolist()
    return r


def test_full_diffusion_demo_model():
    from dinfer_jax import load_model
    from dinfer_jax.tokenizer import load_tokenizer
    model, tok = load_model(DEMO_MODEL_DIR), load_tokenizer(DEMO_MODEL_DIR)
    ids = np.asarray(tok.encode_prompt("add 123+045="), np.int32)
    _check_rows(model, [ids] * 3, SamplingParams(gen_length=16, block_length=16), model.config.eos_token_id)


def test_block_diffusion():
    """cache='block' on a random block-causal model whose EOS is set to the token it writes most."""
    cfg = preset("tiny-llada2")
    from demo_helpers import peaky_random_params
    params = peaky_random_params(cfg, seed=11)
    base = SamplingParams(gen_length=16, block_length=8, cache="block", threshold=0.3)
    prompts = [np.asarray(p, np.int32) for p in ([5, 17, 3, 99, 42], [5, 17, 3, 99, 42], [5, 17, 3, 99, 42])]
    probe = Model(cfg.replace(eos_token_id=None), params).generator.generate(prompts[:1], base)
    toks, counts = np.unique(probe.raw_ids[0], return_counts=True)
    eos = int(toks[np.argmax(counts)])
    if eos == cfg.mask_token_id:
        pytest.fail("the probe decode left masks")
    _check_rows(Model(cfg.replace(eos_token_id=eos, pad_token_id=0), params), prompts, base, eos)


def test_cli_flags(capsys):
    import json

    from dinfer_jax.cli import main
    main(["generate", "--prompt", "add 123+045=", "--ignore-eos", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert len(out["token_ids"]) == 16 and 0 not in out["token_ids"]
    main(["generate", "--prompt", "add 123+045=", "--min-tokens", "6", "--json"])
    assert len(json.loads(capsys.readouterr().out)["token_ids"]) >= 6
