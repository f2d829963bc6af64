"""Subprocess body for tests/test_export_mesh.py: 8 fake CPU devices must be set before jax starts.

  python export_mesh_worker.py   -> prints one JSON line (last line of stdout):
  {"exports": [row, ...], "cuda_mesh_error": str | null, "logits_max_abs_diff": float, "logits_max_abs": float}
"""
from __future__ import annotations

import json
import os

from fast_compile import enable_shared_cache, xla_flags  # noqa: E402

os.environ["XLA_FLAGS"] = xla_flags(8)
os.environ["JAX_PLATFORMS"] = "cpu"
enable_shared_cache()

import jax  # noqa: E402
import numpy as np  # noqa: E402

from dinfer_jax import sharding as shd  # noqa: E402
from dinfer_jax.aot import abstract_model, export_generate  # noqa: E402
from dinfer_jax.families import preset, presets  # noqa: E402
from dinfer_jax.engine import SamplingParams  # noqa: E402
from dinfer_jax.model import Model  # noqa: E402
from dinfer_jax.models import init_params  # noqa: E402

MODELS = [m for m in ("llada-moe-7b-a1b", "llada-8b", "llada2-mini") if m in presets()]
NEW_JAX = tuple(int(x) for x in jax.__version__.split(".")[:2]) >= (0, 11)
out = {"exports": [], "cuda_mesh_error": None}
sp = SamplingParams(gen_length=128, block_length=64, cache="dual")
for spec in ("data=2,expert=4", "data=2,expert=2,model=2"):
    mesh = shd.make_mesh(spec)
    for name in MODELS:
        for platform in ("tpu", "cuda"):
            try:
                r = export_generate(preset(name), platform, batch=16, prompt_len=64, sampling=sp,
                                    model=abstract_model(preset(name), platform, mesh=mesh))
            except RuntimeError as e:  # newer jax: Triton needs an abstract GPU, shard_map a CPU mesh
                if platform != "cuda" or not NEW_JAX:
                    raise
                out["cuda_mesh_error"] = str(e)[:200]
                continue
            out["exports"].append(dict(model=name, mesh=spec, **r.row()))

# The shard_map'd kernel gives the single-device result (tiny model, CPU target: interpreted).
cfg = preset("tiny")
params = init_params(cfg, seed=5)
ids = np.random.RandomState(0).randint(0, cfg.vocab_size, (4, 24))
mask = np.ones_like(ids, bool)
mask[1, :7] = False
ref = Model(cfg, params, attention_impl="xla").logits(ids, key_mask=mask)
sharded = Model(cfg, params, attention_impl="pallas").with_mesh(shd.make_mesh("data=2,expert=2,model=2"))
got = sharded.logits(ids, key_mask=mask)
out["logits_max_abs_diff"] = float(np.abs(got - ref).max())
out["logits_max_abs"] = float(np.abs(ref).max())
print(json.dumps(out))
