"""The built-in block-diffusion demo model (LLaDA2 architecture, block 4, trained by
`python -m dinfer_jax.train --block-size 4`): it loads as a block-causal LLaDA2, answers the demo
tasks with block diffusion, and `dinfer-jax eval demo` reports it beside the LLaDA-MoE demo model."""
import json
import subprocess
import sys

import numpy as np
import pytest

from dinfer_jax.checkpoint import DEMO_BLOCK_MODEL_DIR


@pytest.fixture(scope="module")
def block_demo():
    from dinfer_jax import load_model
    from dinfer_jax.tokenizer import load_tokenizer
    return load_model(DEMO_BLOCK_MODEL_DIR), load_tokenizer(DEMO_BLOCK_MODEL_DIR)


def test_block_demo_model_answers_with_block_diffusion(block_demo):
    from dinfer_jax import evaluate as ev
    model, tok = block_demo
    cfg = model.config
    assert (cfg.family, cfg.attention_mask, cfg.block_size, cfg.router) == ("llada2", "block_causal", 4,
                                                                             "sigmoid_group")
    rows = ev.eval_demo_block(model, tok, n=32, seed=77, settings=("one/step", "thr 0.7"), block_length=4)
    one, fast = rows
    assert one["accuracy"] >= 0.9, one  # trained to ~all correct; one token per forward
    assert fast["tpf"] > 1.5 * one["tpf"] and fast["accuracy"] >= one["accuracy"] - 0.1, fast
    assert one["nfe"] > fast["nfe"]


def test_eval_demo_reports_both_models(tmp_path):
    r = subprocess.run([sys.executable, "-m", "dinfer_jax.cli", "eval", "demo", "--n", "6", "--strategy", "fixed",
                        "--cache", "none", "--out", str(tmp_path), "--json"], capture_output=True, text=True,
                       timeout=900)
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)
    models = [row["model"] for row in res["rows"]]
    assert models[0] == "demo_model" and "demo_block_model" in models
    block = [row for row in res["rows"] if row["model"] == "demo_block_model"]
    from dinfer_jax.evaluate import BLOCK_SETTINGS
    assert [row["strategy"] for row in block] == list(BLOCK_SETTINGS)
    assert all(row["cache"] == "block" and np.isfinite(row["tpf"]) for row in block)
    table = (tmp_path / "table.md").read_text()
    assert "## demo_model" in table and "## demo_block_model" in table and "edits / problem" in table
