"""The Generator's bounded program cache (dinfer_jax/program_cache.py): LRU order, the size bound,
eviction under memory-mapping pressure, and that a dropped program really releases its executable
(the mappings come back) and compiles again to the same answer."""
import numpy as np
import pytest

from dinfer_jax import program_cache
from dinfer_jax.program_cache import ProgramCache, memory_map_count


def test_lru_order_and_size_bound():
    dropped = []
    c = ProgramCache(max_programs=2, on_evict=dropped.append)
    built = []

    def build(k):
        return lambda: built.append(k) or f"prog-{k}"
    assert c.get("a", build("a")) == "prog-a"
    c.get("b", build("b"))
    assert c.get("a", build("a")) == "prog-a"  # a hit: a is now the most recent
    c.get("c", build("c"))
    assert dropped == ["b"] and c.keys() == ["a", "c"] and built == ["a", "b", "c"]
    c.get("b", build("b"))  # built again after its eviction
    assert built == ["a", "b", "c", "b"] and dropped == ["b", "a"] and c.evicted == 2
    with pytest.raises(ValueError, match="max_programs"):
        ProgramCache(max_programs=0)


def test_map_pressure_drops_oldest_but_keeps_the_new_one(monkeypatch):
    pressure = {"on": False}
    monkeypatch.setattr(program_cache, "maps_near_limit", lambda fraction=0.5: pressure["on"])
    c = ProgramCache(max_programs=10)
    for k in "abc":
        c.get(k, lambda k=k: k)
    pressure["on"] = True  # stays high: everything but the program being added goes
    c.get("d", lambda: "d")
    assert c.keys() == ["d"]


@pytest.mark.skipif(memory_map_count() is None, reason="needs /proc/self/maps (Linux)")
def test_evicted_program_releases_its_mappings_and_compiles_again():
    from dinfer_jax import load_model
    from dinfer_jax.checkpoint import DEMO_MODEL_DIR
    from dinfer_jax.engine import Generator, SamplingParams
    model = load_model(DEMO_MODEL_DIR)
    gen = Generator(model, max_programs=1)
    prompt = [np.arange(3, 9, dtype=np.int32)]
    p8, p16 = (SamplingParams(gen_length=g, block_length=8, cache="dual") for g in (8, 16))
    first = gen.generate(prompt, p8).token_ids
    before = memory_map_count()
    gen.generate(prompt, p16)  # evicts the gen-8 program
    import gc
    gc.collect()
    after_swap = memory_map_count()
    compiles = gen.compiles
    assert gen.generate(prompt, p8).token_ids == first and gen.compiles == compiles + 1  # compiled again
    # one program's mappings were released when the other came in: the count stayed flat instead of
    # growing by a program's worth (hundreds on XLA:CPU)
    assert after_swap - before < 100, (before, after_swap)
