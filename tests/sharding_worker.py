"""Subprocess body for the mesh tests (tests/test_sharding.py): fake CPU devices must be set
before jax starts, so every mesh family runs here, in its own process.

  python sharding_worker.py JOB.json      -> prints one JSON line (last line of stdout)

JOB: {"devices": 8, "model": folder, "meshes": [spec, ...], "settings": [SamplingParams kwargs, ...],
      "extra_settings_mesh": spec | null, "extra_settings": [...], "prompts": [[ids], ...],
      "logits_ids": [[ids], ...], "save": folder | null, "save_mesh": spec | null,
      "restore_mesh": spec | null,
      "distributed": {"coordinator": "localhost:PORT", "num_processes": 2, "process_id": 0} | null}
"""
from __future__ import annotations

import json
import os
import sys

from fast_compile import enable_shared_cache, xla_flags  # noqa: E402

job = json.load(open(sys.argv[1]))
os.environ["XLA_FLAGS"] = xla_flags(job["devices"])
os.environ["JAX_PLATFORMS"] = "cpu"
enable_shared_cache()

from dinfer_jax import sharding as shd  # noqa: E402

if job.get("distributed"):
    d = job["distributed"]
    shd.initialize_distributed(d["coordinator"], d["num_processes"], d["process_id"])

import jax  # noqa: E402
import numpy as np  # noqa: E402

from dinfer_jax import load_model  # noqa: E402
from dinfer_jax.engine import SamplingParams  # noqa: E402


def run(model, settings):
    out = {}
    ids = np.asarray(job["logits_ids"], np.int32)
    if ids.shape[0] % model.data_parallel == 0:
        out["logits"] = model.logits(ids).tolist()
    out["generate"] = []
    for kw in settings:
        r = model.generator.generate([np.asarray(p, np.int32) for p in job["prompts"]], SamplingParams(**kw))
        out["generate"].append({"tokens": r.token_ids, "nfe": r.nfe})
    return out


def expert_layout(model):
    """Per device: which slice of the experts / FFN dim of gate_proj (L_, E, D, F) it holds."""
    w = model.params["layers"]["mlp"].get("gate_proj")
    if w is None or w.ndim != 4:
        return None
    rows = []
    for s in w.addressable_shards:
        e, f = s.index[1], s.index[3]
        rows.append({"device": s.device.id, "shape": list(s.data.shape),
                     "experts": [e.start or 0, e.stop if e.stop is not None else w.shape[1]],
                     "ffn": [f.start or 0, f.stop if f.stop is not None else w.shape[3]]})
    return rows


result = {"process_index": jax.process_index(), "device_count": jax.device_count()}
if not job.get("distributed"):
    base = load_model(job["model"])  # one device, no mesh: the reference
    result["single"] = run(base, job["settings"] + job.get("extra_settings", []))
result["meshes"] = {}
for spec in job.get("meshes", []):
    mesh = shd.make_mesh(spec)
    try:
        m = load_model(job["model"], mesh=mesh)
    except shd.ShardingError as e:
        result["meshes"][spec] = {"error": str(e)}
        continue
    settings = job["settings"] + (job.get("extra_settings", []) if spec == job.get("extra_settings_mesh") else [])
    r = run(m, settings)
    r["experts"] = expert_layout(m)
    r["batch_error"] = None
    try:
        m.logits(np.zeros((m.data_parallel + 1, 4), np.int32)) if m.data_parallel > 1 else None
    except shd.ShardingError as e:
        r["batch_error"] = str(e)
    result["meshes"][spec] = r
if job.get("save"):
    from dinfer_jax import checkpoint as ckpt
    from dinfer_jax.families import to_hf_dict
    m = load_model(job["model"], mesh=shd.make_mesh(job["save_mesh"]))
    ckpt.save_params(job["save"], m.params, to_hf_dict(m.config))
    restored = load_model(job["save"], mesh=shd.make_mesh(job["restore_mesh"]))
    src = load_model(job["model"])
    from dinfer_jax.models import flatten
    a, b = flatten(src.params), flatten(restored.params)
    result["restore"] = {
        "bit_exact": all(np.array_equal(np.asarray(a[k]), shd.to_host(b[k])) for k in a),
        "specs": {k: str(b[k].sharding.spec) for k in b},
        "logits": restored.logits(np.asarray(job["logits_ids"], np.int32)).tolist(),
    }
if jax.process_index() == 0:
    print(json.dumps(result))
