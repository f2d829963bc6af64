"""Checkpoints written before format v2 (LM head stored as `lm_head/kernel` (D, V)) still load,
export and shard, with the same numbers as the v2 folder they were derived from, and `upgrade`
rewrites them as v2 (dinfer_jax/checkpoint.py, module doc).

The v1 folders here are made from v2 ones by the inverse of the migration (transpose the LM head
slabs, rename, manifest version 1): the transposition is exact, so every comparison is bitwise.
"""
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from dinfer_jax import checkpoint as ckpt

LEGACY = {"lm_head/unembedding": "lm_head/kernel", "lm_head/unembedding@scale": "lm_head/kernel@scale"}


def _as_v1(src: str, dst: str) -> str:
    """Copy of the v2 folder `src` as a v1 folder (module doc)."""
    shutil.copytree(src, dst)
    man = json.load(open(os.path.join(dst, ckpt.MANIFEST)))
    assert man["version"] == 2
    for new, old in LEGACY.items():
        if new not in man["params"]:
            continue
        arr = ckpt.read_slab(dst, new, None)
        shutil.rmtree(os.path.dirname(ckpt._slab_dir(dst, new, None)))
        c = ckpt._checkpointer()
        c.save(ckpt._slab_dir(dst, old, None), {"w": np.ascontiguousarray(arr.T)})
        c.wait_until_finished()
        spec = man["params"].pop(new)
        man["params"][old] = dict(spec, shape=spec["shape"][::-1])
    q = man.get("quantization") or {}
    for new, old in LEGACY.items():
        if new in q:
            m = dict(q.pop(new))
            assert m.pop("out_first") is True
            q[old] = m
    man["version"] = 1
    json.dump(man, open(os.path.join(dst, ckpt.MANIFEST), "w"))
    return dst


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """(v2 demo, its v1 copy, int8 v2, its v1 copy, fp8 v2, its v1 copy)."""
    from converters import convert, export
    t = tmp_path_factory.mktemp("v1")
    hf = str(t / "hf")
    export(ckpt.DEMO_MODEL_DIR, hf, progress=False)
    out = [ckpt.DEMO_MODEL_DIR, _as_v1(ckpt.DEMO_MODEL_DIR, str(t / "demo_v1"))]
    for kind in ("int8", "fp8"):
        convert(hf, str(t / kind), progress=False, quantize=kind)
        out += [str(t / kind), _as_v1(str(t / kind), str(t / f"{kind}_v1"))]
    return out


def test_v1_reads_as_v2_bit_for_bit(folders):
    """read_manifest / read_params of every v1 folder equal the v2 folder's, quantized leaves too
    (the LM head comes back out-first)."""
    from dinfer_jax.models.quant import QuantizedWeight
    for v2, v1 in zip(folders[::2], folders[1::2]):
        m1, m2 = ckpt.read_manifest(v1), ckpt.read_manifest(v2)
        assert m1["params"] == m2["params"] and m1.get("quantization") == m2.get("quantization")
        p1, p2 = ckpt.read_params(v1), ckpt.read_params(v2)
        assert p1.keys() == p2.keys()
        for k in p2:
            a, b = p1[k], p2[k]
            if isinstance(b, QuantizedWeight):
                assert isinstance(a, QuantizedWeight) and (a.kind, a.out_first) == (b.kind, b.out_first)
                a, b = (a.q, a.scale), (b.q, b.scale)
            else:
                a, b = (a,), (b,)
            for x, y in zip(a, b):
                assert x.dtype == y.dtype and x.shape == y.shape and np.asarray(x).tobytes() == np.asarray(y).tobytes(), k
    assert ckpt.read_params(folders[3])["lm_head/unembedding"].out_first


def test_v1_loads_generates_exports_and_upgrades(folders, tmp_path):
    from converters import export
    from dinfer_jax import load_model
    v2, v1 = str(tmp_path / "v2"), str(tmp_path / "v1")
    shutil.copytree(folders[0], v2)
    shutil.copytree(folders[1], v1)
    ids = np.arange(24) % 100
    ref = load_model(v2).logits(ids)
    np.testing.assert_array_equal(load_model(v1).logits(ids), ref)
    export(v1, str(tmp_path / "hf1"), progress=False)
    export(v2, str(tmp_path / "hf2"), progress=False)
    from safetensors.numpy import load_file
    import glob
    t1 = {k: v for f in glob.glob(str(tmp_path / "hf1" / "*.safetensors")) for k, v in load_file(f).items()}
    t2 = {k: v for f in glob.glob(str(tmp_path / "hf2" / "*.safetensors")) for k, v in load_file(f).items()}
    assert t1.keys() == t2.keys() and all(t1[k].tobytes() == t2[k].tobytes() for k in t2)
    assert ckpt.upgrade(v1) is True and ckpt.upgrade(v1) is False
    assert json.load(open(os.path.join(v1, ckpt.MANIFEST)))["version"] == 2
    assert not os.path.exists(os.path.dirname(ckpt._slab_dir(v1, "lm_head/kernel", None)))
    np.testing.assert_array_equal(load_model(v1).logits(ids), ref)


def test_v1_quantized_loads_sharded(folders, tmp_path):
    """A quantized v1 folder restored onto a mesh of 2 fake CPU devices (its LM head slabs go through
    the transposing read + device_put) gives the v2 folder's logits."""
    v2, v1 = folders[2], folders[3]
    code = f"""
import os; os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2 " + os.environ.get("DINFER_TEST_XLA_FLAGS", ""); os.environ["JAX_PLATFORMS"] = "cpu"
import numpy as np
from dinfer_jax import load_model, sharding as shd
ids = np.arange(32).reshape(2, 16) % 100
a = load_model({v1!r}, mesh=shd.make_mesh("data=1,model=2")).logits(ids)
b = load_model({v2!r}, mesh=shd.make_mesh("data=1,model=2")).logits(ids)
print("MAXDIFF", float(np.abs(a - b).max()))
"""
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env,
                       cwd=os.path.dirname(os.path.dirname(__file__)))
    assert p.returncode == 0, p.stderr[-3000:]
    assert float(next(line for line in p.stdout.splitlines() if line.startswith("MAXDIFF")).split()[1]) == 0.0


def test_interrupted_upgrade(folders, tmp_path):
    """An upgrade cut short: a partial v2 LM head slab (no orbax commit marker) next to the intact v1
    one is ignored when reading; a v2 folder that still holds the v1 slab (cut between the manifest
    and the cleanup) loses it on the next upgrade call."""
    from dinfer_jax import load_model
    v1 = shutil.copytree(folders[1], str(tmp_path / "v1"))
    ids = np.arange(24) % 100
    ref = load_model(folders[0]).logits(ids)
    partial = ckpt._slab_dir(v1, "lm_head/unembedding", None)
    os.makedirs(partial)
    open(os.path.join(partial, "half_written"), "w").close()
    np.testing.assert_array_equal(load_model(v1).logits(ids), ref)
    assert ckpt.upgrade(v1) is True
    stale = ckpt._slab_dir(v1, "lm_head/kernel", None)
    shutil.copytree(ckpt._slab_dir(folders[1], "lm_head/kernel", None), stale)  # as if the cleanup never ran
    assert ckpt.upgrade(v1) is False and not os.path.exists(os.path.dirname(stale))
    np.testing.assert_array_equal(load_model(v1).logits(ids), ref)
