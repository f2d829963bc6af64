"""XProf traces of a generation: `dinfer-jax profile ... --logdir DIR`. The program is compiled and
run once, then `repeats` generations run inside `jax.profiler.trace(DIR)`; named regions (host:
dinfer_profile, dinfer_generate; device: jax named scopes) and how to read them: docs/profiling.md.
"""
from __future__ import annotations

import glob
import os


def profile_generation(model, prompts, params, logdir: str, repeats: int = 1) -> dict:
    """Warm up, then trace `repeats` generations into logdir. Returns {trace_files, result}."""
    import jax
    os.makedirs(logdir, exist_ok=True)
    model.generator.generate(prompts, params)  # compile outside the trace
    with jax.profiler.trace(logdir):
        with jax.profiler.TraceAnnotation("dinfer_profile"):
            for _ in range(repeats):
                result = model.generator.generate(prompts, params)
    files = sorted(glob.glob(os.path.join(logdir, "plugins", "profile", "*", "*")))
    return {"trace_files": files, "result": result}
