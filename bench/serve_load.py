"""Open-loop load on the server: the static batcher and the continuous scheduler side by side.

For each scheduler, an in-process server (uvicorn on a loopback port, the built-in demo model) gets
Poisson arrivals at --rate requests/s for --duration seconds: streaming /v1/completions with demo
task prompts and a mix of max_tokens (--max-tokens, e.g. 16,32,64: different generation lengths,
so different compiled programs). Every program is compiled by a warmup request first. Each request
records the time to its first streamed block and its end-to-end latency; the client waits at most
--drain seconds after the last arrival (the run is bounded), and unfinished requests are counted.

Closed loop (--concurrency 1,8,64,200): for each level C, C clients each send a request, wait for
its answer, and send the next, for --duration seconds; requests still open --drain seconds after
that are "lost". One table row per (scheduler, C).

Reports per scheduler: completed requests/s, generated tokens/s, p50/p99 time to first block and
end-to-end latency, errors (non-200 status or an error event) and lost requests; writes --json and a
plot (--plot, open loop only).

  python bench/serve_load.py [--rate 40] [--duration 20] [--max-tokens 16,32,64] [--json F] [--plot F]
  python bench/serve_load.py --concurrency 1,8,64,200 --duration 20 [--json F]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import socket
import statistics
import sys
import threading
import time


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class InProcessServer:
    """uvicorn serving create_app(...) on a loopback port from a background thread."""

    def __init__(self, model, tok, cfg, chat_formatter=None):
        import uvicorn
        from dinfer_jax.serving.http import create_app
        self.port = _free_port()
        self.app = create_app(model, tok, cfg, chat_formatter)
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self):
        self.thread.start()
        t = time.time()
        while not self.server.started:
            if time.time() - t > 60:
                raise RuntimeError("server did not start")
            time.sleep(0.05)
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(timeout=30)

    def wait_ready(self, timeout: float = 1800.0):
        """Block until /health answers 200 (`--warmup` compiles first)."""
        import httpx
        t = time.time()
        while httpx.get(f"{self.url}/health", timeout=60).status_code != 200:
            if time.time() - t > timeout:
                raise RuntimeError("the server did not become ready")
            time.sleep(0.5)
        return time.time() - t

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


async def _one(client, url, prompt, max_tokens, t_send, rec):
    body = {"model": "demo", "prompt": prompt, "max_tokens": max_tokens, "stream": True}
    r = {"sent": t_send, "max_tokens": max_tokens, "first": None, "end": None, "tokens": 0, "ok": False}
    rec.append(r)
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
            text = ""
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                d = json.loads(line[6:])
                if "error" in d:
                    r["error"] = str(d["error"])[:200]
                    return
                delta = d["choices"][0]["text"] if d.get("choices") else ""
                if delta and r["first"] is None:
                    r["first"] = time.perf_counter()
                text += delta
            r["end"] = time.perf_counter()
            r["ok"] = resp.status_code == 200
            if not r["ok"]:
                r["error"] = f"HTTP {resp.status_code}"
            r["tokens"] = len(text)  # the demo model's tokenizer is one character per token
            if r["first"] is None:
                r["first"] = r["end"]
    except Exception as e:  # noqa: BLE001  (a failed request is counted, not fatal)
        r["error"] = repr(e)


async def _load(url, prompts, rate, duration, drain, mix, seed):
    import httpx
    rng = random.Random(seed)
    rec, tasks = [], []
    async with httpx.AsyncClient(timeout=None, limits=httpx.Limits(max_connections=1000)) as client:
        for mt in sorted(set(mix)):  # warmup: compile every program (not measured)
            await _one(client, url, prompts[0], mt, time.perf_counter(), [])
        t0 = time.perf_counter()
        t = t0
        i = 0
        while True:
            t += rng.expovariate(rate)
            if t - t0 > duration:
                break
            await asyncio.sleep(max(0.0, t - time.perf_counter()))
            tasks.append(asyncio.create_task(_one(client, url, prompts[i % len(prompts)], rng.choice(mix),
                                                  time.perf_counter(), rec)))
            i += 1
        end_arrivals = time.perf_counter()
        _, pending = await asyncio.wait(tasks, timeout=drain) if tasks else (None, [])
        for p in pending:
            p.cancel()
        t_end = time.perf_counter()
    return rec, t0, end_arrivals, t_end


async def _closed(url, prompts, concurrency, duration, drain, mix, seed):
    """`concurrency` clients, each sending its next request when the previous one is answered."""
    import httpx
    rng = random.Random(seed)
    rec = []
    async with httpx.AsyncClient(timeout=None, limits=httpx.Limits(max_connections=max(1000, 2 * concurrency))) as client:
        for mt in sorted(set(mix)):  # warmup: compile every program (not measured)
            await _one(client, url, prompts[0], mt, time.perf_counter(), [])
        t0 = time.perf_counter()
        stop = t0 + duration

        async def client_loop(k):
            i = k
            while time.perf_counter() < stop:
                await _one(client, url, prompts[i % len(prompts)], rng.choice(mix), time.perf_counter(), rec)
                i += concurrency

        tasks = [asyncio.create_task(client_loop(k)) for k in range(concurrency)]
        _, pending = await asyncio.wait(tasks, timeout=duration + drain)
        for p in pending:
            p.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        t_end = time.perf_counter()
    return rec, t0, t_end


def _pct(v, q):
    if not v:
        return float("nan")
    v = sorted(v)
    return v[min(len(v) - 1, int(round(q / 100 * (len(v) - 1))))]


def summarize(rec, t0, t_end):
    done = [r for r in rec if r["ok"]]
    span = t_end - t0
    ttfb = [r["first"] - r["sent"] for r in done]
    e2e = [r["end"] - r["sent"] for r in done]
    errors = [r for r in rec if not r["ok"] and "error" in r]
    return {"sent": len(rec), "completed": len(done), "unfinished": len(rec) - len(done),
            "errors": len(errors), "lost": len(rec) - len(done) - len(errors),
            "error_examples": sorted({r["error"] for r in errors})[:5],
            "requests_per_s": len(done) / span, "tokens_per_s": sum(r["tokens"] for r in done) / span,
            "ttfb_p50": _pct(ttfb, 50), "ttfb_p99": _pct(ttfb, 99), "e2e_p50": _pct(e2e, 50),
            "e2e_p99": _pct(e2e, 99), "e2e_mean": statistics.mean(e2e) if e2e else float("nan"),
            "seconds": span}


def run(rate=40.0, duration=20.0, drain=60.0, mix=(16, 32, 64), schedulers=("static", "continuous"),
        max_batch=16, seed=0, segment=None):
    from dinfer_jax import load_model
    from dinfer_jax import tasks as T
    from dinfer_jax.checkpoint import DEMO_MODEL_DIR
    from dinfer_jax.engine import SamplingParams
    from dinfer_jax.serving.scheduler import ServerConfig
    from dinfer_jax.tokenizer import load_tokenizer
    tok = load_tokenizer(DEMO_MODEL_DIR)
    prompts = [p["prompt"] for p in T.sample(256, seed=seed)]
    out = {"rate": rate, "duration": duration, "max_tokens_mix": list(mix), "max_batch": max_batch, "runs": {}}
    for sched in schedulers:
        kw = dict(model_name="demo", max_batch=max_batch, max_queue=100000, scheduler=sched,
                  default_params=SamplingParams(block_length=16))  # the demo model's block (as `serve` picks)
        if segment:
            kw["segment"] = segment
        model = load_model(DEMO_MODEL_DIR)  # each scheduler its own compiled-program cache
        with InProcessServer(model, tok, ServerConfig(**kw)) as srv:
            rec, t0, t_arr, t_end = asyncio.run(_load(srv.url, prompts, rate, duration, drain, list(mix), seed))
            s = summarize(rec, t0, t_end)
            s["server_stats"] = {k: v for k, v in srv.app.state.batcher.snapshot().items()
                                 if isinstance(v, (int, float, dict))}
        out["runs"][sched] = s
        print(f"{sched:>10}: {s['completed']}/{s['sent']} done, {s['requests_per_s']:.1f} req/s, "
              f"{s['tokens_per_s']:.0f} tok/s, TTFB p50 {1e3 * s['ttfb_p50']:.0f} ms p99 {1e3 * s['ttfb_p99']:.0f} ms, "
              f"E2E p50 {1e3 * s['e2e_p50']:.0f} ms p99 {1e3 * s['e2e_p99']:.0f} ms", flush=True)
    if "static" in out["runs"] and "continuous" in out["runs"]:
        a, b = out["runs"]["static"], out["runs"]["continuous"]
        out["continuous_vs_static"] = {"tokens_per_s": b["tokens_per_s"] / max(a["tokens_per_s"], 1e-9),
                                       "e2e_p99": b["e2e_p99"] / a["e2e_p99"] if a["e2e_p99"] else float("nan")}
    return out


def run_closed(levels=(1, 8, 64, 200), duration=20.0, drain=60.0, mix=(16, 32, 64),
               schedulers=("static", "continuous"), max_batch=16, seed=0, segment=None, cache=None):
    """Closed-loop table: one in-process server per scheduler, every concurrency level in turn."""
    from dinfer_jax import load_model
    from dinfer_jax import tasks as T
    from dinfer_jax.checkpoint import DEMO_MODEL_DIR
    from dinfer_jax.engine import SamplingParams
    from dinfer_jax.serving.scheduler import ServerConfig
    from dinfer_jax.tokenizer import load_tokenizer
    tok = load_tokenizer(DEMO_MODEL_DIR)
    prompts = [p["prompt"] for p in T.sample(256, seed=seed)]
    out = {"mode": "closed", "duration": duration, "max_tokens_mix": list(mix), "max_batch": max_batch,
           "levels": list(levels), "segment": segment, "cache": cache, "rows": []}
    for sched in schedulers:
        kw = dict(model_name="demo", max_batch=max_batch, max_queue=100000, scheduler=sched.split("-")[0],
                  repack=sched != "continuous-norepack",
                  default_params=SamplingParams(block_length=16, **({"cache": cache} if cache else {})),
                  **({"segment": segment} if segment else {}),
                  # as `serve --warmup --warmup-max-tokens <mix>`: every batch bucket compiled first
                  warmup=True, warmup_max_tokens=tuple(sorted(set(mix))),
                  warmup_prompt_len=max(len(tok.encode(p)) for p in prompts))
        model = load_model(DEMO_MODEL_DIR)  # each scheduler its own compiled-program cache
        with InProcessServer(model, tok, ServerConfig(**kw)) as srv:
            print(f"{sched}: warmup {srv.wait_ready():.0f} s", flush=True)
            for c in levels:
                rec, t0, t_end = asyncio.run(_closed(srv.url, prompts, c, duration, drain, list(mix), seed))
                s = summarize(rec, t0, t_end)
                s.update(scheduler=sched, concurrency=c)
                st = srv.app.state.batcher.snapshot()
                s["server_stats"] = {k: v for k, v in st.items() if isinstance(v, (int, float))}
                out["rows"].append(s)
                print(f"{sched:>10} c={c:<4}: {s['requests_per_s']:6.1f} req/s, E2E p50 {1e3 * s['e2e_p50']:6.0f} ms "
                      f"p99 {1e3 * s['e2e_p99']:6.0f} ms, {s['completed']}/{s['sent']} ok, "
                      f"{s['errors']} errors, {s['lost']} lost", flush=True)
    return out


def table(out) -> str:
    """Markdown table of a closed-loop run."""
    lines = ["| scheduler | concurrency | req/s | tokens/s | E2E p50 ms | E2E p99 ms | ok / sent | errors | lost |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in out["rows"]:
        lines.append(f"| {r['scheduler']} | {r['concurrency']} | {r['requests_per_s']:.1f} | {r['tokens_per_s']:.0f} | "
                     f"{1e3 * r['e2e_p50']:.0f} | {1e3 * r['e2e_p99']:.0f} | {r['completed']}/{r['sent']} | "
                     f"{r['errors']} | {r['lost']} |")
    return "\n".join(lines)


def plot(out, path) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    runs = out["runs"]
    names = list(runs)
    fig, axes = plt.subplots(1, 3, figsize=(11, 3.6))
    axes[0].bar(names, [runs[n]["tokens_per_s"] for n in names], color=["C0", "C1"][:len(names)])
    axes[0].set_title("generated tokens/s")
    for i, k in enumerate(("ttfb", "e2e")):
        ax = axes[i + 1]
        x = range(len(names))
        ax.bar([j - 0.2 for j in x], [1e3 * runs[n][f"{k}_p50"] for n in names], 0.4, label="p50")
        ax.bar([j + 0.2 for j in x], [1e3 * runs[n][f"{k}_p99"] for n in names], 0.4, label="p99")
        ax.set_xticks(list(x), names)
        ax.set_title({"ttfb": "time to first block (ms)", "e2e": "end-to-end latency (ms)"}[k])
        ax.legend(fontsize=8)
    fig.suptitle(f"demo model, Poisson {out['rate']:.0f} req/s for {out['duration']:.0f} s, "
                 f"max_tokens {out['max_tokens_mix']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _separately(argv: list[str], schedulers: list[str], closed: bool) -> dict:
    """Run each scheduler in a fresh process of this script and merge their JSON. One process for
    all would be unfair to the later ones: on XLA:CPU the earlier servers' compiled programs keep
    their memory mappings (~24k for the static warmup here), so a later server's program cache,
    which drops programs while the process holds over half of vm.max_map_count
    (dinfer_jax/program_cache.py), evicts its own warmed programs and recompiles them under load."""
    import os
    import subprocess
    import tempfile
    rest = [x for i, x in enumerate(argv) if not (x.startswith("--schedulers") or x.startswith("--json") or
                                                  (i > 0 and argv[i - 1] in ("--schedulers", "--json")))]
    merged = None
    with tempfile.TemporaryDirectory() as tmp:
        for sched in schedulers:
            path = os.path.join(tmp, f"{sched}.json")
            subprocess.run([sys.executable, os.path.abspath(__file__), *rest, "--schedulers", sched, "--json", path],
                           check=True)
            with open(path) as f:
                one = json.load(f)
            if merged is None:
                merged = one
            elif closed:
                merged["rows"] += one["rows"]
            else:
                merged["runs"].update(one["runs"])
    if not closed and "static" in merged["runs"] and "continuous" in merged["runs"]:
        a, b = merged["runs"]["static"], merged["runs"]["continuous"]
        merged["continuous_vs_static"] = {"tokens_per_s": b["tokens_per_s"] / max(a["tokens_per_s"], 1e-9),
                                          "e2e_p99": b["e2e_p99"] / a["e2e_p99"] if a["e2e_p99"] else float("nan")}
        c = merged["continuous_vs_static"]
        print(f"continuous / static: tokens/s x{c['tokens_per_s']:.2f}, p99 latency x{c['e2e_p99']:.2f}")
    return merged


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rate", type=float, default=40.0, help="Poisson arrival rate, requests/s")
    ap.add_argument("--duration", type=float, default=20.0, help="seconds of arrivals")
    ap.add_argument("--drain", type=float, default=60.0, help="seconds to wait for stragglers after the last arrival")
    ap.add_argument("--max-tokens", default="16,32,64", help="comma-separated max_tokens mix")
    ap.add_argument("--max-batch", type=int, default=16)
    ap.add_argument("--segment", type=int, default=None, help="continuous scheduler: iterations per segment")
    ap.add_argument("--schedulers", default="static,continuous",
                    help="comma-separated: static, continuous, continuous-norepack (closed loop: without repacking)")
    ap.add_argument("--cache", default=None, help="the server's default cache (default: the demo's dual)")
    ap.add_argument("--concurrency", default=None,
                    help="closed loop instead of Poisson arrivals: comma-separated client counts, e.g. 1,8,64,200")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    ap.add_argument("--plot", default=None)
    a = ap.parse_args(argv)
    mix = [int(x) for x in a.max_tokens.split(",")]
    argv = sys.argv[1:] if argv is None else list(argv)
    scheds = a.schedulers.split(",")
    if len(scheds) > 1:  # one fresh process per scheduler (see _separately), merged here
        out = _separately(argv, scheds, closed=bool(a.concurrency))
        out["command"] = "python bench/serve_load.py " + " ".join(argv)
        if a.json:
            with open(a.json, "w") as f:
                json.dump(out, f, indent=1)
        if a.concurrency:
            print(table(out))
        elif a.plot and plot(out, a.plot):
            print(f"plot: {a.plot}")
        return
    if a.concurrency:
        out = run_closed([int(x) for x in a.concurrency.split(",")], a.duration, a.drain, mix,
                         a.schedulers.split(","), a.max_batch, a.seed, a.segment, a.cache)
        out["command"] = "python bench/serve_load.py " + " ".join(argv)
        if a.json:
            with open(a.json, "w") as f:
                json.dump(out, f, indent=1)
        print(table(out))
        return
    out = run(a.rate, a.duration, a.drain, [int(x) for x in a.max_tokens.split(",")], a.schedulers.split(","),
              a.max_batch, a.seed, a.segment)
    out["command"] = "python bench/serve_load.py " + " ".join(argv)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    if a.plot and plot(out, a.plot):
        print(f"plot: {a.plot}")
    if "continuous_vs_static" in out:
        c = out["continuous_vs_static"]
        print(f"continuous / static: tokens/s x{c['tokens_per_s']:.2f}, p99 latency x{c['e2e_p99']:.2f}")


if __name__ == "__main__":
    main()
