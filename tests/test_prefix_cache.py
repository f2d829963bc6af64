"""Prompt prefix cache for block-causal models (decoding/prefix_cache.py): bounded LRU store, and
exact reuse inside continuous batches: a prompt whose leading blocks come from the cache decodes
exactly as alone, its prompt K/V equal a full prefill's, only the uncached tail is prefilled, and
poisoned cache entries change the answer (the cache is really read)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dinfer_jax.decoding.prefix_cache import PrefixCache, chain_keys
from dinfer_jax.engine import SamplingParams, generate


def _canvas(values, n=4):
    """A (k, v) canvas cache (layers 2, batch 1, len(values) blocks of n, K*H 2) whose block i
    holds values[i]; one block = 2 * 2 * n * 2 * 4 bytes = 128 (k and v)."""
    a = jnp.repeat(jnp.asarray(values, jnp.float32), n)[None, None, :, None] * jnp.ones((2, 1, 1, 2))
    return a, -a


@pytest.mark.smoke
def test_chain_keys_name_the_whole_prefix():
    a = chain_keys(list(range(10)), 4)
    assert len(a) == 2  # full blocks only; the 2-token tail is not cached
    b = chain_keys([99] + list(range(1, 10)), 4)
    assert a[0] != b[0] and a[1] != b[1]  # same second block after a different first block: another key
    assert chain_keys(list(range(10)), 4) == a and chain_keys(list(range(10)), 5)[0] != a[0]


@pytest.mark.smoke
def test_lru_budget_and_ancestors_outlive_descendants():
    pc = PrefixCache(max_bytes=3 * 128)
    ka = chain_keys(list(range(12)), 4)  # chain a0 -> a1 -> a2
    pc.insert(ka, _canvas([0.0, 1.0, 2.0]), [0, 0, 0], [0, 4, 8], 4)
    assert len(pc) == 3 and pc.bytes == 3 * 128 and pc.pool[0].shape[0] == 3
    assert len(pc.lookup(ka)) == 3  # the hit refreshes a2, a1, a0 (a0 most recent)
    kb = chain_keys([7] * 4, 4)
    pc.insert(kb, _canvas([9.0]), [0], [0], 4)  # over budget: the least recently used goes, the deepest block a2
    assert len(pc) == 3 and pc.bytes <= pc.max_bytes and pc.stats["evictions"] == 1
    slots = pc.lookup(ka)
    assert len(slots) == 2
    placed = pc.place(slots + pc.lookup(kb), [0, 0, 0], [0, 4, 8], 1, 12)  # a0, a1, b0 laid out again
    np.testing.assert_array_equal(np.asarray(placed[0][0, 0, :, 0]), [0.0] * 4 + [1.0] * 4 + [9.0] * 4)
    np.testing.assert_array_equal(np.asarray(placed[1]), -np.asarray(placed[0]))
    s = pc.snapshot()
    assert s["blocks_looked_up"] == 7 and s["blocks_hit"] == 6 and s["hit_rate"] == round(6 / 7, 4)
    assert PrefixCache(0).enabled is False
    with pytest.raises(ValueError, match="prefix cache size"):
        PrefixCache(-1)


@pytest.fixture(scope="module")
def tiny_llada2():
    from demo_helpers import peaky_random_params

    from dinfer_jax.families import preset
    from dinfer_jax.model import Model
    cfg = preset("tiny-llada2")  # block-causal, attention block 8
    return Model(cfg, peaky_random_params(cfg, seed=11))


SP = SamplingParams(gen_length=16, block_length=8, cache="block", threshold=0.9)


def _prompts():
    rng = np.random.default_rng(0)
    system = rng.integers(0, 100, 40).tolist()  # 5 shared full blocks
    return [system + rng.integers(0, 100, n).tolist() for n in (3, 9, 17, 11)]


def _run(model, prompts, pc_bytes, poison=None):
    """Admit prompts one or two at a time into one RunningBatch of 4 slots (the cache fills as they
    go) -> (results by index, the batch, {index: that row's K/V after its admission})."""
    from dinfer_jax.decoding.prefix_cache import PrefixCache
    gen = model.generator
    gen.prefix_cache = PrefixCache(pc_bytes)
    rb = gen.running_batch(SP, 4, max(map(len, prompts)))
    res, kv_after = {}, {}
    for group in ([0], [1, 2], [3]):
        if poison is not None and len(gen.prefix_cache):
            poison(gen.prefix_cache)
        slots = rb.admit([(i, np.asarray(prompts[i], np.int32), SP) for i in group])
        for i, b in zip(group, slots):
            pad, full = int(rb.pad[b]), (len(prompts[i]) // 8) * 8
            kv_after[i] = [np.asarray(c[:, b, pad:pad + full]) for c in rb.state.kv]
        while rb.running:
            for r in rb.step(8):
                res[r.tag] = r
    return res, rb, kv_after


def test_cached_prefix_decodes_exactly_as_alone(tiny_llada2):
    prompts = _prompts()
    res, rb, kv_hit = _run(tiny_llada2, prompts, 1 << 20)
    s = rb.prefix_cache.snapshot()
    # prompt 0 misses; 1 and 2 (admitted together) reuse the 5 system blocks; 3 reuses them too
    assert s["blocks_hit"] == 15 and s["tokens_reused"] == 120, s
    assert s["prefill_tokens"] < s["prefill_tokens_full"]
    for i, p in enumerate(prompts):
        alone = generate(tiny_llada2, [p], SP)
        assert res[i].raw_ids.tolist() == alone.raw_ids[0].tolist(), i
        assert res[i].nfe == alone.nfe[0], i
    # the K/V of a prompt assembled from the cache + a short prefill equal a full prefill's
    _, rb0, kv_full = _run(tiny_llada2, prompts, 0)
    assert rb0.prefix_cache is None
    for i in range(1, 4):
        for got, want in zip(kv_hit[i], kv_full[i]):
            # fp32 rounding of differently shaped GEMMs (measured 2e-6 on values ~2, i.e. ~20 ulp)
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_poisoned_cache_entries_change_the_answer(tiny_llada2):
    """A test that fails if cached K/V were not read: scrambling them changes prompt 3's K/V."""
    prompts = _prompts()

    def poison(pc):
        pc.pool = (pc.pool[0] * 0 + 3.0, pc.pool[1] * 0 - 3.0)
    _, _, kv_bad = _run(tiny_llada2, prompts, 1 << 20, poison=poison)
    _, _, kv_full = _run(tiny_llada2, prompts, 0)
    assert np.abs(kv_bad[3][0] - kv_full[3][0]).max() > 1.0


def test_full_attention_models_never_use_it():
    from demo_helpers import demo as load
    model, _ = load()  # LLaDA-MoE demo model: full attention
    model.generator.prefix_cache = PrefixCache(1 << 20)
    try:
        sp = SamplingParams(gen_length=16, block_length=8, cache="dual")
        assert model.generator.running_batch(sp, 4, 8).prefix_cache is None
    finally:
        model.generator.prefix_cache = PrefixCache(0)
