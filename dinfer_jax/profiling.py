"""XProf traces of a generation: `dinfer-jax profile ... --logdir DIR`.

The program is compiled and run once before tracing (so the trace shows steady-state execution,
not compilation), then `repeats` generations run inside `jax.profiler.trace(DIR)`. Named regions:
  host:   dinfer_profile (the traced span), dinfer_generate (one per generation call)
  device: denoise_loop, forward_full, forward_window, strategy, attention_core, layers (jax
          named scopes inside the jitted loop: in the HLO ops' metadata; on CPU only there, on
          TPU / GPU also XProf's "Framework Name Scope" trace line)
Viewing it, and the top ops by self time (bench/profile_top_ops.py): docs/profiling.md.
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
