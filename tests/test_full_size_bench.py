"""bench/full_size.py runs its whole pipeline (synthetic random checkpoint -> convert in a
subprocess -> bf16 load -> dual-cache generation + bare forwards) at tiny shapes."""
import json

from bench.full_size import main


def test_full_size_pipeline_tiny(tmp_path):
    out = tmp_path / "row.json"
    row = main(["--workdir", str(tmp_path / "w"), "--tiny", "--prompt-len", "12", "--gen-length", "32",
                "--block-length", "16", "--steps", "4", "--repeats", "1", "--out", str(out)])
    assert json.loads(out.read_text())["nfe_full"] == row["nfe_full"]
    # dual cache, fixed schedule: one full refresh per block and the block's remaining steps as windows
    assert row["nfe_full"] == 2 and row["nfe_window"] == 2
    assert row["convert"]["params"] == row["params"] and row["full_refresh_s"] > 0 and row["window_forward_s"] > 0
    # reusing the folders skips writing and converting
    again = main(["--workdir", str(tmp_path / "w"), "--tiny", "--prompt-len", "12", "--gen-length", "32",
                  "--block-length", "16", "--steps", "4", "--repeats", "1"])
    assert "reused" in again["write"]["note"] and "reused" in again["convert"]["note"]


def test_throughput_measure_and_plots(tmp_path):
    from bench.throughput_plots import measure, plot
    from dinfer_jax import load_model
    from dinfer_jax.checkpoint import DEMO_MODEL_DIR
    from dinfer_jax.tokenizer import load_tokenizer
    model, tok = load_model(DEMO_MODEL_DIR), load_tokenizer(DEMO_MODEL_DIR)
    row = measure(model, tok, 2, "threshold", "dual", repeats=1)
    # the trained demo model answers demo problems, several tokens per forward
    assert row["accuracy"] == 1.0 and row["tpf"] > 1 and row["tokens"] > 0 and row["tokens_per_s"] > 0
    rows = [dict(row, batch=b, strategy=s, tokens_per_s=float(b)) for b in (1, 2) for s in ("fixed", "threshold")]
    plot(rows, "batch", "strategy", str(tmp_path / "b.png"), "t")
    plot(rows, "strategy", "cache", str(tmp_path / "s.png"), "t")
    assert (tmp_path / "b.png").stat().st_size > 1000 and (tmp_path / "s.png").stat().st_size > 1000
