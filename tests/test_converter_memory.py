"""Converter peak memory on a ~1.6 GiB synthetic LLaDA-MoE checkpoint (bf16, 4 shards).

The conversion runs in a fresh subprocess that reports its peak RSS (ru_maxrss) before and after
`convert`. The converter holds one "unit" at a time: one layer slab of a layer-stacked param
(here one layer's (E, D, F) experts, 64 MiB) or one unstacked tensor. Bound: 3 units (the slab
being assembled, orbax's host copy while saving it, slack for the source piece and allocator)
+ 64 MiB. A converter that held a whole stacked tensor (512 MiB) or the model would fail it.
"""
import json
import subprocess
import sys
import textwrap

import ml_dtypes
import numpy as np
import pytest

from bench.make_synthetic_checkpoint import pattern_value, write_synthetic
from dinfer_jax.config import preset

pytestmark = pytest.mark.slow

CHILD = textwrap.dedent("""
    import json, resource, sys
    import orbax.checkpoint  # noqa: F401  (imports count as baseline)
    from converters import convert
    from dinfer_jax.models import abstract_params
    from dinfer_jax.config import load_hf_config
    abstract_params(load_hf_config(sys.argv[1]))
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    convert(sys.argv[1], sys.argv[2], progress=False)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"base": base, "peak": peak}))
""")


def test_peak_rss_bounded_by_one_layer_slab(tmp_path):
    cfg = preset("tiny").replace(num_layers=8, hidden_size=1024, num_heads=16, num_kv_heads=16, head_dim=64,
                                 intermediate_size=512, num_experts=64, num_experts_per_tok=8, vocab_size=8192,
                                 mask_token_id=8191, eos_token_id=8190, pad_token_id=8190)
    total = write_synthetic(str(tmp_path / "hf"), cfg, shards=4)
    largest = 8 * 64 * 1024 * 512 * 2  # one whole (layers, E, D, F) bf16 expert tensor: 512 MiB
    unit = largest // 8  # one layer's slab of it: 64 MiB (the embedding is 16 MiB)
    assert total > 1.5 * 2**30
    out = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path / "hf"), str(tmp_path / "ck")],
                         capture_output=True, text=True, check=True)
    r = json.loads(out.stdout.strip().splitlines()[-1])
    used = r["peak"] - r["base"]
    print(f"\nconverter: {total / 2**30:.2f} GiB checkpoint, largest stacked param {largest / 2**20:.0f} MiB, "
          f"peak RSS {r['peak'] / 2**20:.0f} MiB (baseline {r['base'] / 2**20:.0f} MiB, +{used / 2**20:.0f} MiB)")
    assert used <= 3 * unit + 64 * 2**20
    assert used < largest
    # Spot-check content: expert 5 of layer 3, gate_proj (transposed, pattern value preserved).
    from dinfer_jax.checkpoint import read_param
    g = read_param(str(tmp_path / "ck"), "layers/mlp/gate_proj")
    assert g.shape == (8, 64, 1024, 512) and g.dtype == np.dtype(ml_dtypes.bfloat16)
    want = np.asarray(pattern_value("model.layers.3.mlp.experts.5.gate_proj.weight"), ml_dtypes.bfloat16)
    assert (g[3, 5] == want).all()
    with open(tmp_path / "ck" / "dinfer_jax.json") as f:
        assert len(json.load(f)["params"]) == 15
