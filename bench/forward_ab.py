"""One forward, side by side: dinfer-jax source trees (e.g. main vs a branch) and eager PyTorch,
alternating rounds in one run, with the fraction of the measured GEMM peak each forward reaches.

  git archive main | tar -x -C /tmp/base      # the baseline tree
  python bench/forward_ab.py --trees base=/tmp/base new=. --model medium --rounds 9
  python bench/forward_ab.py --trees base=/tmp/base new=. --model moe --layers 1 --torch --rounds 7
  python bench/forward_ab.py --tiny                 # seconds (tests)

Models (fp32, CPU, random normal(0, 0.02) weights, batch 1, canvas 192 = prompt 128 + gen 64, block
32 at 128; bench/roofline.py's shapes):
  medium  LLaDA dense d 1024, 8 layers, 16 heads, ffn 2816, vocab 32000 (bench/compare_peers.py)
  moe     LLaDA-MoE-7B-A1B widths (d 2048, 16x128 heads, 64 experts top-8 of width 1024,
          vocab 157184), --layers of them (default 1)
Kinds: full = the full refresh (all 192 positions, K/V out, logits for the block); dual = the
dual-cache window forward (the block's 32 tokens over the cached K/V, logits for the block).
`peak` = a 2048^3 fp32 jnp.dot (bench/roofline.py measure_matmul_peak's GEMM), timed in the same
rounds; % peak = the forward's useful FLOPs (roofline.forward_cost) / time / the median peak.

Each tree runs in its own worker process (PYTHONPATH = the tree) that compiles once and then times
`--reps` calls per round on request; rounds alternate the order of the workers; the table gives
medians over rounds of the per-round medians, with [min, max] over rounds. Every tree's logits and
K/V are compared with the first tree's (max abs difference printed). --torch adds a worker with
the transformers model of the same architecture (LlamaForCausalLM / Qwen3MoeForCausalLM, its own
random init of the same distribution, sdpa attention) run eagerly as bench/compare_torch.py's
TorchPeer does (full_forward with K/V; window_forward over the cached K/V).
Threads: every worker is pinned to the first --threads CPUs (torch.set_num_threads too).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PROMPT, GEN, BLOCK = 128, 64, 32


def model_config(name: str, layers: int):
    from dinfer_jax.families import preset
    if name == "medium":
        from bench.compare_peers import MODELS
        return preset("tiny-dense").replace(rope_theta=10000.0, max_position_embeddings=4096, **MODELS["medium"])
    if name == "moe":
        return preset("llada-moe-7b-a1b").replace(num_layers=layers or 1)
    if name == "tiny-moe":
        from bench.roofline import tiny_configs
        return tiny_configs()[0]
    if name == "tiny-dense":
        from bench.roofline import tiny_configs
        return tiny_configs()[1]
    raise SystemExit(f"unknown model {name!r}")


def useful_flops(cfg, kind: str) -> float:
    from bench import roofline as rl
    return rl.kind_cost(cfg, kind, 1, PROMPT, GEN, BLOCK, dtype_bytes=4)["flops"]


# ---------------------------------------------------------------------------------------------
# workers: read "KIND REPS" lines, answer one JSON line of seconds


def jax_worker(a):
    import jax
    import jax.numpy as jnp
    import numpy as np
    from bench import roofline as rl
    from dinfer_jax.models import Transformer
    cfg = model_config(a.model, a.layers)
    params = rl.random_params(cfg, jnp.float32)
    module = Transformer(cfg, dtype=jnp.float32)
    gs, Lc = rl.canvas_layout("dual", PROMPT, GEN)
    canvas = rl.random_canvas(cfg, 1, Lc)
    full = jax.jit(rl.forward_fn(module, None, 1, Lc, gs, PROMPT, BLOCK))
    dual = jax.jit(rl.forward_fn(module, (0, BLOCK, 0), 1, Lc, gs, PROMPT, BLOCK))
    logits, kv = full(params, canvas)
    wl, _ = dual(params, canvas, kv)
    np.savez(a.dump, full=np.asarray(logits), k=np.asarray(kv[0]), v=np.asarray(kv[1]), dual=np.asarray(wl))
    n = 2048
    mats = [jax.random.normal(k, (n, n), jnp.float32) for k in jax.random.split(jax.random.key(0), 2)]
    dot = jax.jit(jnp.dot)
    calls = {"full": lambda: full(params, canvas), "dual": lambda: dual(params, canvas, kv),
             "peak": lambda: dot(*mats)}
    for f in calls.values():
        jax.block_until_ready(f())
    serve(calls, lambda f: jax.block_until_ready(f()))


def torch_worker(a):
    import torch
    torch.set_num_threads(a.threads)
    from bench.compare_torch import TorchPeer
    cfg = model_config(a.model, a.layers)
    torch.manual_seed(0)
    common = dict(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_layers,
                  num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                  rms_norm_eps=cfg.rms_norm_eps, max_position_embeddings=cfg.max_position_embeddings,
                  tie_word_embeddings=cfg.tie_word_embeddings, attention_bias=False, initializer_range=0.02)
    if cfg.is_moe:
        from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
        hf = Qwen3MoeConfig(intermediate_size=4 * cfg.hidden_size, moe_intermediate_size=cfg.intermediate_size,
                            num_experts=cfg.num_experts, num_experts_per_tok=cfg.num_experts_per_tok,
                            norm_topk_prob=cfg.norm_topk_prob, decoder_sparse_step=1, mlp_only_layers=[],
                            use_sliding_window=False, **common)
        model = Qwen3MoeForCausalLM(hf)
    else:
        from transformers import LlamaConfig, LlamaForCausalLM
        model = LlamaForCausalLM(LlamaConfig(intermediate_size=cfg.intermediate_size, mlp_bias=False, **common))
    model = model.float().eval()
    peer = TorchPeer(model, cfg.mask_token_id, cfg.eos_token_id)
    Lc = PROMPT + GEN
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, min(cfg.mask_token_id, cfg.eos_token_id), (1, Lc), generator=g)
    a_, b_ = torch.randn(2048, 2048, generator=g), torch.randn(2048, 2048, generator=g)
    with torch.inference_mode():
        _, kv = peer.full_forward(x, PROMPT, PROMPT + BLOCK, want_kv=True)
        calls = {"full": lambda: peer.full_forward(x, PROMPT, PROMPT + BLOCK, want_kv=True),
                 "dual": lambda: peer.window_forward(x[:, PROMPT:PROMPT + BLOCK], PROMPT, kv),
                 "peak": lambda: a_ @ b_}
        for f in calls.values():
            f()
        serve(calls, lambda f: f())


def serve(calls, run):
    print("READY", flush=True)
    for line in sys.stdin:
        kind, reps = line.split()
        ts = []
        for _ in range(int(reps)):
            t = time.perf_counter()
            run(calls[kind])
            ts.append(time.perf_counter() - t)
        print(json.dumps(ts), flush=True)


# ---------------------------------------------------------------------------------------------
# driver


class Worker:
    def __init__(self, name, tree, argv, env_extra=None):
        env = dict(os.environ, PYTHONPATH=os.path.abspath(tree))
        env.update(env_extra or {})
        self.name = name
        self.p = subprocess.Popen([sys.executable, os.path.join(ROOT, "bench", "forward_ab.py")] + argv,
                                  cwd=os.path.abspath(tree), env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  text=True)
        line = self.p.stdout.readline()
        if line.strip() != "READY":
            raise RuntimeError(f"worker {name} failed to start: {line!r}")

    def time(self, kind, reps):
        self.p.stdin.write(f"{kind} {reps}\n")
        self.p.stdin.flush()
        return json.loads(self.p.stdout.readline())

    def close(self):
        self.p.stdin.close()
        self.p.wait()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trees", nargs="+", default=[f"this={ROOT}"], help="NAME=DIR source trees (first = reference)")
    ap.add_argument("--model", default="medium", choices=["medium", "moe", "tiny-moe", "tiny-dense"])
    ap.add_argument("--layers", type=int, default=0, help="moe: layers (default 1)")
    ap.add_argument("--kinds", default="full,dual")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--reps", type=int, default=3, help="calls per worker per round (the round's value: their median)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--torch", action="store_true", help="add the eager PyTorch peer")
    ap.add_argument("--tiny", action="store_true", help="tiny-moe, 2 rounds of 1 call (tests)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--worker", choices=["jax", "torch"], help=argparse.SUPPRESS)
    ap.add_argument("--dump", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        cpus = sorted(os.sched_getaffinity(0))
        if len(cpus) > a.threads:
            os.sched_setaffinity(0, cpus[:a.threads])
        sys.path.insert(0, os.getcwd())
        return (jax_worker if a.worker == "jax" else torch_worker)(a)
    if a.tiny:
        a.model, a.rounds, a.reps = "tiny-moe", 2, 1
    sys.path.insert(0, ROOT)
    import numpy as np
    cfg = model_config(a.model, a.layers)
    kinds = a.kinds.split(",")
    trees = [t.split("=", 1) for t in a.trees]
    common = ["--model", a.model, "--layers", str(a.layers), "--threads", str(a.threads)]
    env = {"OMP_NUM_THREADS": str(a.threads), "MKL_NUM_THREADS": str(a.threads)}
    record = dict(model=a.model, config=cfg.to_dict(), threads=a.threads, rounds=a.rounds, reps=a.reps,
                  command=" ".join(["bench/forward_ab.py"] + (argv if argv is not None else sys.argv[1:])), diffs={})
    with tempfile.TemporaryDirectory() as d:
        workers, dumps = [], []
        for name, tree in trees:  # one at a time: compiles do not overlap
            dumps.append(os.path.join(d, f"{name}.npz"))
            workers.append(Worker(name, tree, ["--worker", "jax", "--dump", dumps[-1]] + common, env))
        if a.torch:
            workers.append(Worker("torch", ROOT, ["--worker", "torch"] + common, env))
        ref = np.load(dumps[0])
        for (name, _), path in zip(trees[1:], dumps[1:]):
            other = np.load(path)
            record["diffs"][name] = {k: float(np.max(np.abs(other[k] - ref[k]))) for k in ref.files}
            print(f"{name} vs {trees[0][0]}: max |diff| " + ", ".join(
                f"{k} {v:.3g} (of {float(np.max(np.abs(ref[k]))):.3g})" for k, v in record["diffs"][name].items()),
                flush=True)
        times = {w.name: {k: [] for k in kinds + ["peak"]} for w in workers}
        for r in range(a.rounds):
            order = workers if r % 2 == 0 else workers[::-1]
            for kind in kinds + ["peak"]:
                for w in order:
                    times[w.name][kind].append(statistics.median(w.time(kind, a.reps)))
        for w in workers:
            w.close()
    record["times"] = times
    flops = {k: useful_flops(cfg, k) for k in kinds}
    record["flops"] = flops
    rows = []
    for w in workers:
        pk = times[w.name]["peak"]
        peak = 2 * 2048 ** 3 / statistics.median(pk)
        for k in kinds:
            ts = times[w.name][k]
            med = statistics.median(ts)
            per_round = [flops[k] / t / (2 * 2048 ** 3 / p) for t, p in zip(ts, pk)]  # vs that round's peak
            rows.append(dict(side=w.name, kind=k, ms=med * 1e3, min_ms=min(ts) * 1e3, max_ms=max(ts) * 1e3,
                             gflops=flops[k] / 1e9, peak_gflops=peak / 1e9, frac_peak=flops[k] / med / peak,
                             frac_peak_rounds=statistics.median(per_round), frac_peak_min=min(per_round),
                             frac_peak_max=max(per_round)))
    record["rows"] = rows
    print(f"\n{a.model}: {cfg.num_layers} layers, D {cfg.hidden_size}, V {cfg.vocab_size}"
          + (f", E {cfg.num_experts} top-{cfg.num_experts_per_tok} F {cfg.intermediate_size}" if cfg.is_moe else
             f", F {cfg.intermediate_size}") + f"; fp32, {a.threads} threads, {a.rounds} alternating rounds x "
          f"{a.reps} calls")
    print("| side | kind | ms median [min, max] over rounds | GFLOP | GEMM peak GFLOP/s (median) | % of peak "
          "(medians) | % of the same round's peak, median [min, max] |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['side']} | {r['kind']} | {r['ms']:.1f} [{r['min_ms']:.1f}, {r['max_ms']:.1f}] | {r['gflops']:.2f} | "
              f"{r['peak_gflops']:.0f} | {100 * r['frac_peak']:.1f}% | {100 * r['frac_peak_rounds']:.1f}% "
              f"[{100 * r['frac_peak_min']:.1f}, {100 * r['frac_peak_max']:.1f}] |")
    names = [w.name for w in workers]
    record["ratios"] = {}
    print("\nspeed ratios (time of A / time of B): ratio of medians; per-round ratio median [min, max]")
    jax_names = names[:-1] if a.torch else names
    pairs = [(names[0], n) for n in jax_names[1:]] + ([("torch", n) for n in jax_names] if a.torch else [])
    for k in kinds:
        for x, y in pairs:
            tx, ty = times[x][k], times[y][k]
            rr = [p / q for p, q in zip(tx, ty)]
            record["ratios"][f"{k}: {x}/{y}"] = dict(of_medians=statistics.median(tx) / statistics.median(ty),
                                                     per_round=statistics.median(rr), min=min(rr), max=max(rr))
            print(f"{k}: {x} / {y} = {statistics.median(tx) / statistics.median(ty):.2f}x; per round "
                  f"{statistics.median(rr):.2f}x [{min(rr):.2f}, {max(rr):.2f}]")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(record, f, indent=1)
    return record


if __name__ == "__main__":
    main()
