"""Benchmark scripts run end to end at tiny shapes on CPU."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.smoke
def test_gpu_kernel_bench_tiny_on_cpu(tmp_path):
    """The GPU benchmark script (ready for a lent GPU)."""
    env = {**os.environ, "OUT": str(tmp_path), "PEERS": str(tmp_path / "no-peers"), "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"]}
    proc = subprocess.run(["bash", os.path.join(ROOT, "bench", "gpu", "run.sh"), "--tiny", "--repeats", "2"],
                          capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "| attention | pallas |" in proc.stdout and "| moe | tiled |" in proc.stdout
    assert '"error"' not in proc.stdout  # xla and pallas both ran
    assert (tmp_path / "kernels_bench.log").is_file()
    e2e = json.loads((tmp_path / "e2e_bench.json").read_text())  # the end-to-end generation part
    assert [r["batch"] for r in e2e["rows"]] == [1, 4]
    for r in e2e["rows"]:
        assert r["nfe_full"] >= 32 // 16 and r["nfe_window"] >= 0 and r["tokens"] == r["batch"] * 32  # no early stop
        assert r["gen_floor_s"] > 0 and r["measured_over_floor"] > 0
    assert "| batch | seconds | NFE full+window |" in (tmp_path / "e2e_bench.log").read_text()
    llada2 = json.loads((tmp_path / "e2e_llada2.json").read_text())  # block diffusion (cache="block")
    assert [r["batch"] for r in llada2["rows"]] == [2]
    assert llada2["rows"][0]["nfe_window"] >= 32 // 8 and llada2["rows"][0]["tokens"] == 2 * 32
    assert "FAILED" not in proc.stdout


def test_roofline_counts_match_xla_cost_analysis(tmp_path):
    """bench/roofline.py --tiny: analytic FLOPs per window kind agree with XLA's own HloCostAnalysis
    count of the same forward (1 layer, all-experts path) within 2%: XLA additionally counts the
    elementwise ops (norms, RoPE, softmax, SiLU), <1% at these matmul-dominated shapes; a missing or
    doubled matmul (q/k/v/o, scores, PV, router, experts, LM head) would be off by >= 3%."""
    out = tmp_path / "roofline.json"
    r = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "roofline.py"), "--tiny", "--out", str(out)],
                       capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())
    checks = res["xla_check"]
    assert {(c["family"], c["kind"]) for c in checks} == {(f, k) for f in ("llada_moe", "llada") for k in ("full", "dual")}
    for c in checks:
        assert 0.0 <= c["rel_diff"] < 0.02, c
    kinds = {row["kind"]: row for row in res["kinds"]}
    assert set(kinds) == {"full", "dual", "prefix", "vicinity"}
    assert kinds["full"]["flops"] > kinds["vicinity"]["flops"] > kinds["dual"]["flops"] > 0
    for k in ("full", "dual"):  # timed (ratios to ceilings measured under test load are not asserted)
        assert kinds[k]["measured_s"] > 0 and kinds[k]["measured_over_floor"] > 0
    assert res["ceilings"]["matmul"]["flops_per_s"] > 1e8 and res["ceilings"]["copy"]["bytes_per_s"] > 1e8


@pytest.mark.smoke
def test_roofline_platforms_consistent(tmp_path):
    """bench/roofline_platforms.py (arithmetic over presets and spec sheets, no compile) on a subset:
    1-byte weights move fewer bytes than bf16, the floor is the max of its two terms, a forward that
    is bandwidth-bound at batch 1 leans further toward FLOPs at batch 64, fp8 on v5e (no fp8 MXU)
    keeps the bf16 rate with int8's bytes, configurations over one chip's HBM are flagged, and the
    loop's tokens/s follow from the per-forward floors."""
    sys.path.insert(0, ROOT)
    from bench import roofline_platforms as rp
    md, js = tmp_path / "r.md", tmp_path / "r.json"
    rp.main(["--platforms", "h200", "v5e", "--models", "llada-moe-7b-a1b", "llada2-mini", "--batches", "1", "64",
             "--out-md", str(md), "--json", str(js), "--quiet"])
    res = json.loads(js.read_text())
    rows = {(r["platform"], r["model"], r["batch"], r["format"], r["kind"]): r for r in res["rows"]}
    assert len(rows) == 2 * 2 * 2 * 3 * 2
    for (p, m, b, f, k), r in rows.items():
        assert r["floor_s"] == max(r["t_flops"], r["t_bytes"]) > 0
        assert r["bound"] == ("FLOPs" if r["t_flops"] >= r["t_bytes"] else "bytes")
        assert abs(r["tok_per_s"] - b * r["tpf"] / r["floor_s"]) < 1e-6 * r["tok_per_s"]
        if f != "bf16":
            bf = rows[(p, m, b, "bf16", k)]
            assert r["bytes"] < bf["bytes"] and r["flops"] == bf["flops"] and r["mem_bytes"] < bf["mem_bytes"]
    lo, hi = rows[("h200", "llada-moe-7b-a1b", 1, "bf16", "dual")], rows[("h200", "llada-moe-7b-a1b", 64, "bf16", "dual")]
    assert lo["bound"] == "bytes" and hi["t_flops"] / hi["t_bytes"] > 4 * lo["t_flops"] / lo["t_bytes"]
    assert hi["intensity"] > lo["intensity"]
    v5e_fp8, v5e_int8 = rows[("v5e", "llada2-mini", 1, "fp8", "block")], rows[("v5e", "llada2-mini", 1, "int8", "block")]
    assert not v5e_fp8["native"] and v5e_fp8["peak"] == rp.PLATFORMS["v5e"]["peak"]["bf16"]
    assert v5e_int8["native"] and v5e_int8["peak"] > v5e_fp8["peak"] and v5e_fp8["bytes"] == v5e_int8["bytes"]
    # LLaDA2-mini: 16 G params, 32.5 GB in bf16: fits an H200 (141 GB), not a 16 GB v5e chip
    assert rows[("h200", "llada2-mini", 1, "bf16", "block")]["fits"]
    big = rows[("v5e", "llada2-mini", 1, "bf16", "block")]
    assert not big["fits"] and big["chips"] == 3
    for lp in res["loops"]:
        t = lp["t_first"] + (lp["block"] / lp["tpf"] - 1) * lp["t_window"]
        assert abs(lp["tok_per_s"] - lp["batch"] * lp["block"] / t) < 1e-6 * lp["tok_per_s"]
    text = md.read_text()
    assert "not measured" in text and "(needs 3 chips)" in text and "| platform | model | batch |" in text


def test_compare_torch_tiny_identical_tokens(tmp_path):
    """bench/compare_torch.py: the transformers peer (fixed / no cache, threshold / dual cache) and
    dinfer-jax give identical tokens and equal NFE on random tiny LLaDA-MoE weights (the script
    raises otherwise), over two blocks so the block-entry cache refresh is exercised."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    out = tmp_path / "compare.json"
    cmd = [sys.executable, os.path.join(ROOT, "bench", "compare_torch.py"), "--random-preset", "tiny",
           "--head-scale", "200", "--prompt-len", "24", "--gen-length", "16", "--block-length", "8", "--num-prompts", "2",
           "--repeats", "1", "--threads", "1", "--out", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [(row["strategy"], row["cache"]) for row in rows] == [("fixed", "none"), ("threshold", "dual")]
    for row in rows:
        assert row["tokens"] > 0 and row["nfe"] > 0
        assert f"| {row['strategy']} | {row['cache']} | 1 | {row['nfe']} | {row['tokens']} |" in r.stdout
    fixed, thr = rows
    assert fixed["nfe_per_prompt"] == [16, 16]  # steps = gen_length: one forward per token
    assert thr["nfe"] < fixed["nfe"]  # the LM head (x200 at this width) makes threshold unmask several per step


def test_profile_forward_tiny(tmp_path):
    """bench/profile_forward.py --tiny: a profiler trace of the forward is written and parsed into
    per-op times and call counts."""
    out = tmp_path / "prof.json"
    r = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "profile_forward.py"), "--tiny", "--kind", "dual",
                        "--out", str(out)], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["forward_ms"] > 0 and len(res["ops"]) > 5
    assert all(v["ms"] >= 0 and v["calls"] > 0 for v in res["ops"].values())
    assert "| op | ms / forward | calls / forward | share |" in r.stdout


@pytest.mark.smoke
def test_tpu_bench_tiny_on_cpu(tmp_path):
    """The TPU benchmark script (ready for a lent TPU): the AOT export step finds Mosaic kernels and
    no interpreted one; the kernel and end-to-end parts run at tiny shapes."""
    env = {**os.environ, "OUT": str(tmp_path), "PEERS": str(tmp_path / "no-peers"), "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"]}
    r = subprocess.run(["bash", os.path.join(ROOT, "bench", "tpu", "run.sh"), "--tiny", "--repeats", "2"],
                       capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    rows = json.loads((tmp_path / "aot_tpu.json").read_text())
    assert [r["cache"] for r in rows] == ["none", "dual"]
    assert all(r["mosaic_calls"] >= 1 and r["interpreted"] == 0 for r in rows)
    assert "| attention | pallas |" in r.stdout and '"error"' not in r.stdout
    assert (tmp_path / "e2e_bench.json").is_file()


def test_compare_peers_needs_checkouts(tmp_path):
    """bench/compare_peers.py imports the peers from checkouts (CI has none): without paths, or with
    a path that is not the right checkout, it stops at argument parsing with a message naming the
    repository to clone, before importing jax or torch."""
    script = os.path.join(ROOT, "bench", "compare_peers.py")
    r = subprocess.run([sys.executable, script], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 2 and "give --fast-dllm PATH and/or --dinfer PATH" in r.stderr, r.stderr
    r = subprocess.run([sys.executable, script, "--fast-dllm", str(tmp_path), "--dinfer", str(tmp_path / "nope")],
                       capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode != 0
    assert "not a checkout of NVlabs/Fast-dLLM (missing llada/generate.py" in r.stderr, r.stderr
    r = subprocess.run([sys.executable, script, "--dinfer", str(tmp_path / "nope")],
                       capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert "not a checkout of inclusionAI/dInfer (missing the folder itself)" in r.stderr, r.stderr


def test_quantize_memory_bench_tiny(tmp_path):
    """bench/quantize_memory.py at the tiny preset: three checkpoints, each loaded in its own process."""
    out = tmp_path / "q.json"
    r = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "quantize_memory.py"), "--preset", "tiny",
                        "--work", str(tmp_path / "work"), "--out", str(out)],
                       capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = json.loads(out.read_text())["results"]
    assert set(rows) == {"bf16", "int8", "fp8"}
    for kind in ("int8", "fp8"):
        assert rows[kind]["disk_bytes"] < rows["bf16"]["disk_bytes"] * 1.5 and rows[kind]["top1_agreement"] > 0.5
        assert rows[kind]["peak_rss_after_load_GiB"] > 0


def test_forward_ab_tiny(tmp_path):
    """bench/forward_ab.py --tiny with two trees (this one twice) and the eager PyTorch peer: the
    trees agree exactly, every side is timed in every round, ratios and % of peak are reported."""
    out = tmp_path / "ab.json"
    r = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "forward_ab.py"), "--tiny", "--torch",
                        "--trees", f"a={ROOT}", f"b={ROOT}", "--out", str(out)],
                       capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())
    assert all(v == 0.0 for v in res["diffs"]["b"].values()), res["diffs"]
    assert {(row["side"], row["kind"]) for row in res["rows"]} == {
        (s, k) for s in ("a", "b", "torch") for k in ("full", "dual")}
    assert all(len(t) == 2 for side in res["times"].values() for t in side.values())
    assert "full: torch / b" in r.stdout and "| side | kind |" in r.stdout


def test_small_gemm_bench_tiny(tmp_path):
    """bench/small_gemm.py at tiny shapes: every GEMM row for jax (both layouts, and pinned to one
    core) and numpy, with positive times."""
    out = tmp_path / "g.json"
    r = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "small_gemm.py"), "--tiny", "--no-torch",
                        "--out", str(out)], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    for g in ("expert M=4", "expert M=8", "expert M=32", "lm head M=32"):
        for impl in ("jax (K, N)", "jax (N, K)", "numpy (K, N)", "jax (K, N) 1 core"):
            assert rows[f"{g} | {impl}"]["ms"] > 0
