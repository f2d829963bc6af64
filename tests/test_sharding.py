"""Meshes (EP x TP x DP), multi-host and checkpoint restore across meshes, on fake CPU devices.

Every mesh family runs in one subprocess (tests/sharding_worker.py) with 8 fake devices; each
compares with the same model on one device, no mesh. fp32, temperature 0: generated tokens must
be identical; logits agree to 2e-6 of the largest |logit| (the expert-parallel psum adds the
top-k contributions in another order than the single-device einsum: a few fp32 ulps).
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import numpy as np
import pytest

from dinfer_jax import sharding as shd
from dinfer_jax.models import placement

WORKER = os.path.join(os.path.dirname(__file__), "sharding_worker.py")
MOE_MESHES = ["data=8", "expert=8", "data=2,expert=4", "expert=4,model=2", "data=2,expert=2,model=2"]
DENSE_MESHES = ["data=8", "data=2,model=4", "expert=2,model=4", "data=2,expert=2,model=2"]
SETTINGS = [dict(gen_length=16, block_length=8, strategy="threshold", threshold=0.3, cache="dual")]
EXTRA = [dict(gen_length=16, block_length=8, strategy="fixed", steps=8, cache="none"),
         dict(gen_length=16, block_length=8, strategy="threshold", threshold=0.3, cache="prefix"),
         dict(gen_length=16, block_length=8, strategy="credit", cache="vicinity", prefix_look=4, after_look=4)]
PROMPTS = [[5, 17, 3, 99, 42], [7, 8, 9, 10, 11, 12, 13, 14, 15], [1, 2], [60, 61, 62, 63]]
LOGITS_IDS = (np.arange(8 * 12).reshape(8, 12) * 7 % 120).tolist()
LOGIT_TOL = 2e-6


def _run_worker(job: dict, tmp_path, name: str, timeout=600) -> dict:
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(job))
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    p = subprocess.run([sys.executable, WORKER, str(path)], capture_output=True, text=True, timeout=timeout, env=env)
    assert p.returncode == 0, p.stderr[-4000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def _check_same(ref: dict, got: dict, where: str):
    if "logits" in got:
        a, b = np.asarray(ref["logits"]), np.asarray(got["logits"])
        assert np.abs(a - b).max() <= LOGIT_TOL * np.abs(a).max(), f"{where}: logits differ"
        assert (a.argmax(-1) == b.argmax(-1)).all(), f"{where}: argmax differs"
    for i, (r, g) in enumerate(zip(ref["generate"], got["generate"])):
        assert g["tokens"] == r["tokens"], f"{where}: setting {i}: tokens differ"
        assert g["nfe"] == r["nfe"], f"{where}: setting {i}: NFE differs"


@pytest.fixture(scope="module")
def moe_result(moe_hf_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("moe_mesh")
    job = {"devices": 8, "model": moe_hf_dir, "meshes": MOE_MESHES, "settings": SETTINGS,
           "extra_settings_mesh": "data=2,expert=2,model=2", "extra_settings": EXTRA,
           "prompts": PROMPTS, "logits_ids": LOGITS_IDS,
           "save": str(tmp / "saved"), "save_mesh": "data=2,expert=4", "restore_mesh": "expert=2,model=4"}
    return _run_worker(job, tmp, "moe")


@pytest.mark.parametrize("spec", MOE_MESHES)
def test_moe_mesh_matches_single_device(moe_result, spec):
    got = moe_result["meshes"][spec]
    assert "error" not in got, got.get("error")
    _check_same(moe_result["single"], got, spec)  # the (2, 2, 2) mesh also runs the EXTRA settings


def test_each_expert_lives_only_on_its_shard(moe_result):
    E, F = 8, 32  # tiny preset: 8 experts, F 32
    for spec in MOE_MESHES:
        sizes = shd.parse_mesh_spec(spec)
        ep, tp = sizes["expert"], sizes["model"]
        layout = moe_result["meshes"][spec]["experts"]
        assert len(layout) == 8
        for row in layout:
            assert row["shape"][1] == E // ep and row["shape"][3] == F // tp, (spec, row)
            assert row["experts"][1] - row["experts"][0] == E // ep
        # every (expert slice, ffn slice) appears on exactly (8 / (ep * tp)) devices: the data replicas
        slices = [(tuple(r["experts"]), tuple(r["ffn"])) for r in layout]
        assert len(set(slices)) == ep * tp, spec
        assert all(slices.count(s) == 8 // (ep * tp) for s in set(slices)), spec


def test_batch_that_does_not_split_is_a_clear_error(moe_result):
    err = moe_result["meshes"]["data=8"]["batch_error"]
    assert err and "data axis of size 8" in err


def test_checkpoint_saved_on_one_mesh_restores_into_another(moe_result):
    r = moe_result["restore"]
    assert r["bit_exact"]
    assert r["specs"]["layers/mlp/gate_proj"] == str(shd.P(None, "expert", None, "model"))
    a, b = np.asarray(moe_result["single"]["logits"]), np.asarray(r["logits"])
    assert np.abs(a - b).max() <= LOGIT_TOL * np.abs(a).max()


def test_dense_tensor_parallel_meshes_match_single_device(dense_hf_dir, tmp_path):
    job = {"devices": 8, "model": dense_hf_dir, "meshes": DENSE_MESHES, "settings": SETTINGS,
           "prompts": PROMPTS, "logits_ids": LOGITS_IDS}
    res = _run_worker(job, tmp_path, "dense")
    for spec in DENSE_MESHES:
        got = res["meshes"][spec]
        assert "error" not in got, got.get("error")
        _check_same(res["single"], got, spec)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_one_global_mesh(moe_model, tmp_path):
    """2 processes x 4 CPU devices (gloo), one ("data"=2, "expert"=4) mesh over all 8: process 0's
    tokens equal one device's. The model is restored from a dinfer-jax checkpoint by every process."""
    from dinfer_jax import checkpoint as ckpt
    from dinfer_jax.families import to_hf_dict
    from dinfer_jax.engine import SamplingParams
    folder = str(tmp_path / "ckpt")
    ckpt.save_params(folder, moe_model.params, to_hf_dict(moe_model.config))
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    procs = []
    for pid in range(2):
        job = {"devices": 4, "model": folder, "meshes": ["data=2,expert=4"], "settings": SETTINGS,
               "prompts": PROMPTS, "logits_ids": LOGITS_IDS,
               "distributed": {"coordinator": f"localhost:{port}", "num_processes": 2, "process_id": pid}}
        path = tmp_path / f"mh{pid}.json"
        path.write_text(json.dumps(job))
        procs.append(subprocess.Popen([sys.executable, WORKER, str(path)], stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True, env=env))
    outs = [p.communicate(timeout=600) for p in procs]
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err[-4000:]
    res = json.loads(outs[0][0].strip().splitlines()[-1])
    assert res["device_count"] == 8 and res["process_index"] == 0
    assert not [ln for ln in outs[1][0].splitlines() if ln.startswith("{")], "only process 0 prints results"
    got = res["meshes"]["data=2,expert=4"]
    ref_logits = moe_model.logits(np.asarray(LOGITS_IDS))
    r = moe_model.generator.generate([np.asarray(p) for p in PROMPTS], SamplingParams(**SETTINGS[0]))
    _check_same({"logits": ref_logits.tolist(), "generate": [{"tokens": r.token_ids, "nfe": r.nfe}]}, got, "2 processes")


# ------------------------------------------------------------------- in-process (one device)
class _MeshShape:
    """Enough of a Mesh for the rule resolution (sizes only)."""

    def __init__(self, **sizes):
        self.shape = shd.parse_mesh_spec(sizes)


@pytest.mark.smoke
def test_mesh_spec_errors():
    assert shd.parse_mesh_spec("data=2, expert=4") == {"data": 2, "expert": 4, "model": 1}
    for bad, msg in [("data", "axis=size"), ("data=x", "not an integer"), ("pipeline=2", "unknown axes"),
                     ("data=0", "positive"), ("data=-1,model=-1", "at most one -1")]:
        with pytest.raises(shd.ShardingError, match=msg):
            shd.parse_mesh_spec(bad)
    with pytest.raises(shd.ShardingError, match="needs 2 devices but 1"):
        shd.make_mesh("data=2")
    assert shd.make_mesh("data=-1").shape["data"] == 1


@pytest.mark.smoke
def test_mesh_that_does_not_divide_the_model_is_a_clear_error():
    from dinfer_jax.families import preset
    cfg = preset("tiny")  # 8 experts, 4 heads, F 32
    with pytest.raises(shd.ShardingError, match="'expert' of size 3"):
        placement.check_mesh_fits(cfg, _MeshShape(expert=3))
    with pytest.raises(shd.ShardingError, match="'heads' of size 4 is not divisible by mesh axis 'model' of size 8"):
        placement.check_mesh_fits(cfg, _MeshShape(model=8))
    placement.check_mesh_fits(cfg, _MeshShape(data=4, expert=8, model=4))  # kv heads (2) stay replicated


@pytest.mark.smoke
def test_logical_rules_resolution():
    m = _MeshShape(data=2, expert=4, model=2)
    assert shd.logical_spec(("batch", "length", "embed"), (8, 5, 64), m) == shd.P(("data", "expert"), None, None)
    assert shd.logical_spec(("batch", "length", "embed"), (2, 5, 64), m) == shd.P("data", None, None)
    assert shd.logical_spec(("batch",), (1,), m) == shd.P(None)
    assert shd.logical_spec(("layers", "expert", "embed", "mlp"), (2, 8, 64, 32), m, strict=True) == \
        shd.P(None, "expert", None, "model")
    assert shd.logical_spec(("embed", "kv_heads", "head_dim"), (64, 1, 16), m) == shd.P(None, None, None)
    with pytest.raises(shd.ShardingError, match="no rule"):
        shd.logical_spec(("nonsense",), (4,), m)


@pytest.mark.smoke
def test_expert_tensor_data_parallel_smoke(tmp_path):
    """No torch: a random tiny LLaDA-MoE saved as a dinfer-jax checkpoint, run on one device and
    on a (2, 2, 2) mesh (also the python3.12 / newest-jax check of shard_map and the mesh API)."""
    from dinfer_jax import checkpoint as ckpt
    from dinfer_jax.families import preset, to_hf_dict
    from dinfer_jax.models import init_params
    cfg = preset("tiny")
    folder = str(tmp_path / "ckpt")
    ckpt.save_params(folder, init_params(cfg, seed=5), to_hf_dict(cfg))
    job = {"devices": 8, "model": folder, "meshes": ["data=2,expert=2,model=2"], "settings": SETTINGS,
           "prompts": PROMPTS, "logits_ids": LOGITS_IDS}
    res = _run_worker(job, tmp_path, "smoke")
    got = res["meshes"]["data=2,expert=2,model=2"]
    _check_same(res["single"], got, "data=2,expert=2,model=2")
    assert {tuple(r["experts"]) for r in got["experts"]} == {(0, 4), (4, 8)}


def test_llada2_expert_parallel_matches_single_device(tmp_path):
    """A random tiny LLaDA2 (block-causal, sigmoid group router with expert bias, shared expert,
    leading dense layer) on expert=8 (2 of 16 experts per device) and a (2, 2, 2) mesh."""
    from dinfer_jax import checkpoint as ckpt
    from dinfer_jax.families import preset, to_hf_dict
    from dinfer_jax.models import init_params
    cfg = preset("tiny-llada2")
    folder = str(tmp_path / "ckpt")
    ckpt.save_params(folder, init_params(cfg, seed=6), to_hf_dict(cfg))
    meshes = ["expert=8", "data=2,expert=2,model=2"]
    job = {"devices": 8, "model": folder, "meshes": meshes, "prompts": PROMPTS, "logits_ids": LOGITS_IDS,
           "settings": [SETTINGS[0], dict(gen_length=16, block_length=8, strategy="fixed", steps=8, cache="none")]}
    res = _run_worker(job, tmp_path, "llada2")
    for spec in meshes:
        got = res["meshes"][spec]
        assert "error" not in got, got.get("error")
        _check_same(res["single"], got, spec)
    assert {tuple(r["experts"]) for r in res["meshes"]["expert=8"]["experts"]} == {(2 * i, 2 * i + 2) for i in range(8)}


@pytest.mark.smoke
def test_llada2_mini_param_shardings_on_8_devices():
    """LLaDA2-mini's 256 experts over 8 devices (32 each), expert FFN / shared expert / dense layer
    / attention over "model", router and expert bias replicated."""
    from dinfer_jax.families import preset
    from dinfer_jax.models import abstract_params
    cfg = preset("llada2-mini")
    shapes = {k: v.shape for k, v in abstract_params(cfg).items()}
    axes = placement.param_logical_axes(cfg)
    m = _MeshShape(expert=4, model=2)
    spec = {k: shd.logical_spec(axes[k], shapes[k], m, strict=True, what=k) for k in axes}
    assert spec["layers/mlp/gate_proj"] == shd.P(None, "expert", None, "model")
    assert spec["layers/mlp/router"] == shd.P(None, None, None)
    assert spec["layers/mlp/router_bias"] == shd.P(None, None)
    assert spec["layers/mlp/shared/gate_proj"] == shd.P(None, None, "model")
    assert spec["dense_layers/mlp/down_proj"] == shd.P(None, "model", None)
    assert spec["layers/attn/q_proj"] == shd.P(None, None, "model", None)
    placement.check_mesh_fits(cfg, _MeshShape(expert=8))
    placement.check_mesh_fits(cfg, _MeshShape(data=2, expert=8, model=4))  # kv heads (4) split over model=4
