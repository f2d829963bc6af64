"""Shared fixtures: tiny HF checkpoint folders written once per session (real names, real formats)."""
from __future__ import annotations

import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))
from fast_compile import FAST_XLA_FLAGS, enable_shared_cache, remove_cache_made_here, shared_cache_dir  # noqa: E402,I001

# Fast XLA:CPU compiles in this process and every subprocess that inherits the environment.
os.environ["DINFER_TEST_XLA_FLAGS"] = FAST_XLA_FLAGS  # for subprocesses that set their own XLA_FLAGS
if FAST_XLA_FLAGS not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {FAST_XLA_FLAGS}".strip()
# The CLI turns JAX's persistent compile cache on by default (~/.cache); tests (in-process CLI calls
# and their subprocesses) use this run's shared temporary cache instead, unless a test sets its own.
_RUN_CACHE = shared_cache_dir()
os.environ.setdefault("DINFER_JAX_COMPILE_CACHE", _RUN_CACHE or "off")
# With libtpu installed (the `tpu` extra) jax would probe for a TPU in every test process; tests run
# on the CPU and compile for TPU only through compile-only topologies (tests/test_tpu_compile.py).
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
# No model hub in tests: a Hub id resolves from the (test-built) cache only, never the network.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

enable_shared_cache()

from dinfer_jax.families import preset  # noqa: E402

# LLaDA-MoE test model: GQA 4/2, 8 experts top-2 (uneven loads at these sizes).
MOE_CFG = preset("tiny")
# LLaDA dense test model with GQA (LLaDA-8B is MHA; n_kv_heads < n_heads is also valid config).
DENSE_CFG = preset("tiny-dense").replace(num_kv_heads=2)


def pytest_unconfigure(config):
    remove_cache_made_here()


@pytest.fixture(scope="module", autouse=True)
def _bounded_memory_maps():
    """Each compiled XLA:CPU program holds hundreds of memory mappings; a worker that compiled
    hundreds of programs reaches vm.max_map_count and segfaults inside the next compile
    (dinfer_jax/program_cache.py). Between modules, past 40% of the cap, drop every cached
    executable (programs still referenced compile again on their next call)."""
    from dinfer_jax.program_cache import maps_near_limit
    if maps_near_limit(0.4):
        import gc

        import jax
        jax.clear_caches()
        gc.collect()
    yield


@pytest.fixture(scope="session")
def moe_ref():
    from hf_reference import llada_moe_state_dict, qwen3_moe_reference
    model = qwen3_moe_reference(MOE_CFG, seed=1)
    return MOE_CFG, model, llada_moe_state_dict(model)


@pytest.fixture(scope="session")
def dense_ref():
    from hf_reference import llada_state_dict, llama_reference
    model = llama_reference(DENSE_CFG, seed=2)
    return DENSE_CFG, model, llada_state_dict(model)


@pytest.fixture(scope="session")
def moe_hf_dir(tmp_path_factory, moe_ref):
    from hf_reference import write_hf_folder
    cfg, _, sd = moe_ref
    d = str(tmp_path_factory.mktemp("moe_hf"))
    write_hf_folder(d, cfg, sd)
    return d


@pytest.fixture(scope="session")
def dense_hf_dir(tmp_path_factory, dense_ref):
    from hf_reference import write_hf_folder
    cfg, _, sd = dense_ref
    d = str(tmp_path_factory.mktemp("dense_hf"))
    write_hf_folder(d, cfg, sd)
    return d


@pytest.fixture(scope="session")
def moe_model(moe_hf_dir):
    from dinfer_jax import load_model
    return load_model(moe_hf_dir)


@pytest.fixture(scope="session")
def dense_model(dense_hf_dir):
    from dinfer_jax import load_model
    return load_model(dense_hf_dir)


@pytest.fixture
def rng():
    return np.random.RandomState(1234)
