"""Summary table of a guidellm JSON report (bench/guidellm.sh): per benchmark (one per stream
count), requests ok / errored / incomplete, requests/s, output tokens/s, TTFT and latency medians
and p99. --expect N: exit 1 unless every benchmark completed N requests with no error."""
from __future__ import annotations

import argparse
import json
import sys


def _m(metrics: dict, name: str, stat: str, sub: str = "successful"):
    d = metrics.get(name, {}).get(sub, {})
    return d.get("percentiles", {}).get(stat) if stat.startswith("p") else d.get(stat)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("report")
    ap.add_argument("--expect", type=int, default=None)
    a = ap.parse_args(argv)
    with open(a.report) as f:
        rep = json.load(f)
    print("| streams | ok | errored | incomplete | req/s | output tok/s | TTFT p50 ms | TTFT p99 ms | "
          "latency p50 s | latency p99 s |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    bad = []
    for b in rep["benchmarks"]:
        m = b["metrics"]
        tot = m["request_totals"]
        streams = b["config"].get("strategy", {}).get("streams", "?")
        print(f"| {streams} | {tot['successful']} | {tot['errored']} | {tot['incomplete']} | "
              f"{_m(m, 'requests_per_second', 'mean'):.2f} | {_m(m, 'output_tokens_per_second', 'mean'):.1f} | "
              f"{_m(m, 'time_to_first_token_ms', 'median'):.1f} | {_m(m, 'time_to_first_token_ms', 'p99'):.1f} | "
              f"{_m(m, 'request_latency', 'median'):.3f} | {_m(m, 'request_latency', 'p99'):.3f} |")
        if a.expect is not None and (tot["successful"] != a.expect or tot["errored"] or tot["incomplete"]):
            bad.append(tot)
    if bad:
        print(f"guidellm smoke failed: {bad}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
