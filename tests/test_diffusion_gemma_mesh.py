"""DiffusionGemma's expert parallelism (models/gemma4.py `_Experts` with a mesh: shard_map, tokens
to their experts' shard, partial sums reduced) on 8 fake CPU devices: the encoder + decoder logits
on an all-axes mesh (data=2, expert=2, model=2: tokens split over "expert" are gathered) and on
expert=8 (a batch of 4 stays replicated over "expert") equal one device's to 2e-6 of the largest
|logit| (the psum adds the top-k contributions in another order: a few fp32 ulps), argmax equal;
`generate` with params placed by `param_shardings` (experts split 4 ways) decodes the same tokens as
one device, and so does a dinfer-jax checkpoint of the same params (written as an HF folder, then
`convert`) loaded onto the mesh. No torch: a random model of the preset diffusion-gemma-tiny."""
from __future__ import annotations

import json
import os
import subprocess
import sys


CODE = r"""
import os
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8 " + os.environ.get("DINFER_TEST_XLA_FLAGS", "")
os.environ["JAX_PLATFORMS"] = "cpu"
import json
import jax, jax.numpy as jnp, numpy as np
from dinfer_jax import sharding as shd
from dinfer_jax.families import diffusion_gemma as dg
from dinfer_jax.models.gemma4 import EncoderCache, Gemma4Diffusion, init_params
cfg, C = dg.preset("diffusion-gemma-tiny")
params = jax.tree_util.tree_map(lambda x: x * 3 if x.ndim >= 2 else x, init_params(cfg, seed=3))  # peakier routing
rng = np.random.RandomState(0)
prompt = jnp.asarray(rng.randint(0, 512, (4, 12)), jnp.int32)
canvas = jnp.asarray(rng.randint(0, 512, (4, C)), jnp.int32)

def logits(mesh):
    m = Gemma4Diffusion(cfg, jnp.float32, mesh)
    def f(p, prompt, canvas):
        cache = m.apply({"params": p}, prompt, EncoderCache.empty(cfg, 4, 12 + C), method=Gemma4Diffusion.encode)
        return m.apply({"params": p}, canvas, cache, None, method=Gemma4Diffusion.decode)
    return np.asarray(jax.jit(f)(params, prompt, canvas))

ref = logits(None)
out = {}
for spec in ("data=2,expert=2,model=2", "expert=8"):
    got = logits(shd.make_mesh(spec))
    out[spec] = [float(np.abs(got - ref).max() / np.abs(ref).max()), bool((got.argmax(-1) == ref.argmax(-1)).all())]
# generate on a mesh (params placed by param_shardings, as load(mesh=) places them) vs one device
mesh = shd.make_mesh("data=2,expert=2,model=2")
placed = jax.device_put(params, dg.param_shardings(cfg, mesh))
s = dg.DiffusionGemmaSettings(max_new_tokens=2 * C, max_denoising_steps=3)
one = dg.generate(dg.DiffusionGemma(cfg, params, C), np.asarray(prompt), s, seed=5)
on_mesh = dg.generate(dg.DiffusionGemma(cfg, placed, C, mesh), np.asarray(prompt), s, seed=5)
experts = [leaf for path, leaf in jax.tree_util.tree_leaves_with_path(placed) if "experts" in jax.tree_util.keystr(path)]
out["generate"] = [bool((one == on_mesh).all()), min(len(e.sharding.device_set) for e in experts),
                   max(e.addressable_shards[0].data.size / e.size for e in experts if e.ndim == 3)]
# the same params through an HF folder (group_to_hf), `convert`, and load(checkpoint, mesh=): each
# param restored straight into its sharding, the same tokens
import tempfile
from converters import convert
from converters.safetensors_io import write_file
d = tempfile.mkdtemp()
os.makedirs(os.path.join(d, "hf"))
write_file(os.path.join(d, "hf", "model.safetensors"),
           {k: np.asarray(v) for g in dg.groups(cfg) for k, v in dg.group_to_hf(params, cfg, g).items()})
with open(os.path.join(d, "hf", "config.json"), "w") as f:
    json.dump(dg.PRESETS["diffusion-gemma-tiny"], f)
convert(os.path.join(d, "hf"), os.path.join(d, "ckpt"), progress=False)
loaded = dg.load(os.path.join(d, "ckpt"), dtype=jnp.float32, mesh=mesh)
experts = [leaf for path, leaf in jax.tree_util.tree_leaves_with_path(loaded.params) if "experts" in jax.tree_util.keystr(path)]
out["checkpoint"] = [bool((dg.generate(loaded, np.asarray(prompt), s, seed=5) == one).all()),
                     min(len(e.sharding.device_set) for e in experts),
                     max(e.addressable_shards[0].data.size / e.size for e in experts if e.ndim == 3)]
print(json.dumps(out))
"""


def test_expert_parallel_logits_equal_one_device():
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    p = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, timeout=600, env=env,
                       cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    for what in ("generate", "checkpoint"):
        same, devices, shard_fraction = out.pop(what)
        assert same and devices == 8 and shard_fraction <= 0.25, (what, same, devices, shard_fraction)  # experts / 4
    for spec, (rel, same_argmax) in out.items():
        assert rel <= 2e-6 and same_argmax, (spec, rel, same_argmax)
