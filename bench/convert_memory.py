"""Peak host memory and time of `convert` on a synthetic checkpoint (see make_synthetic_checkpoint.py).

  python bench/make_synthetic_checkpoint.py /tmp/moe7b --preset llada-moe-7b-a1b
  python bench/convert_memory.py /tmp/moe7b /tmp/moe7b-dj
"""
from __future__ import annotations

import json
import os
import resource
import sys
import time

import numpy as np


def main(src: str, dst: str):
    import orbax.checkpoint  # noqa: F401
    from converters import convert
    from dinfer_jax.families import load_hf_config
    from dinfer_jax.models import abstract_params
    cfg = load_hf_config(src)
    shapes = abstract_params(cfg)
    total = sum(os.path.getsize(os.path.join(src, f)) for f in os.listdir(src) if f.endswith(".safetensors"))
    largest_name, largest = max(((p, int(np.prod(s.shape)) * 2) for p, s in shapes.items()), key=lambda t: t[1])
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    t = time.perf_counter()
    convert(src, dst, progress=False)
    secs = time.perf_counter() - t
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"params": cfg.num_params, "checkpoint_GiB": round(total / 2**30, 2),
                      "largest_param": largest_name, "largest_GiB": round(largest / 2**30, 2),
                      "baseline_rss_GiB": round(base / 2**30, 2), "peak_rss_GiB": round(peak / 2**30, 2),
                      "seconds": round(secs, 1)}))


if __name__ == "__main__":
    main(*sys.argv[1:3])
