"""The trained demo model that ships in the package (dinfer_jax/demo_model)."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from dinfer_jax.checkpoint import DEMO_MODEL_DIR

FRESH_SEED = 20261202  # a seed the training run never drew problems from


@pytest.mark.smoke
def test_shipped_model_files_and_size():
    from dinfer_jax.checkpoint import generation_defaults, is_checkpoint, read_config
    assert is_checkpoint(DEMO_MODEL_DIR)
    for name in ("config.json", "tokenizer.json", "generation_config.json", "training.json"):
        assert os.path.isfile(os.path.join(DEMO_MODEL_DIR, name)), name
    size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(DEMO_MODEL_DIR) for f in fs)
    assert size <= 8 * 10**6, f"shipped demo model is {size / 1e6:.2f} MB (> 8 MB)"
    cfg = read_config(DEMO_MODEL_DIR)
    assert cfg.family == "llada_moe" and cfg.num_experts == 8 and cfg.num_experts_per_tok == 2
    from dinfer_jax.tokenizer import load_tokenizer
    tok = load_tokenizer(DEMO_MODEL_DIR)
    assert tok.vocab_size == cfg.vocab_size and tok.token_to_id("<|mdm_mask|>") == cfg.mask_token_id
    assert tok.token_to_id("<|endoftext|>") == cfg.eos_token_id
    assert generation_defaults(DEMO_MODEL_DIR)["gen_length"] == 16


@pytest.fixture(scope="module")
def demo():
    from demo_helpers import demo as load
    return load()


def test_demo_model_exact_match_one_token_per_step(demo):
    """>= 95% exact match on 100 fresh problems, one token per step (fixed, steps = gen_length)."""
    from dinfer_jax import tasks as T
    from dinfer_jax.evaluate import run_prompts, sampling_params
    model, tok = demo
    probs = T.sample(100, seed=FRESH_SEED)
    run = run_prompts(model, tok, tok.encode_batch([p["prompt"] for p in probs]),
                      sampling_params("fixed", "none", 16, 16), batch_size=128, warmup=False)
    acc = np.mean([o == p["answer"] for o, p in zip(run.outputs, probs)])
    assert all(n == 16 for n in run.nfe)
    assert acc >= 0.95, f"exact match {acc:.2f}: " + str([(p["prompt"], o) for o, p in zip(run.outputs, probs)
                                                         if o != p["answer"]][:10])


def test_demo_model_threshold_decodes_in_parallel(demo):
    """Confidence-based decoding is meaningful on the trained model: several tokens per forward."""
    from dinfer_jax import tasks as T
    from dinfer_jax.evaluate import run_prompts, sampling_params
    model, tok = demo
    probs = T.sample(64, seed=FRESH_SEED + 1)
    run = run_prompts(model, tok, tok.encode_batch([p["prompt"] for p in probs]),
                      sampling_params("threshold", "dual", 16, 16), batch_size=64, warmup=False)
    acc = np.mean([o == p["answer"] for o, p in zip(run.outputs, probs)])
    assert acc >= 0.9 and run.tpf >= 2.0, (acc, run.tpf)


def test_cli_generate_uses_the_demo_model():
    r = subprocess.run([sys.executable, "-m", "dinfer_jax.cli", "generate", "--prompt", "add 123+045=", "--json"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["text"] == "0168" and out["nfe"] >= 1
