"""Strategy unit tests on hand-built logits: ties, all below threshold, mask-token argmax, quotas."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dinfer_jax.decoding import strategies as st
from knobs_helper import row_knobs  # noqa: E402

pytestmark = pytest.mark.smoke

M = 9  # mask id in these tests (V = 10)


def logits_for(confs, tokens, V=10):
    """Rows of logits whose argmax is `tokens[i]` with softmax probability exactly confs[i]."""
    out = np.full((len(confs), V), -np.inf, np.float32)
    for i, (c, t) in enumerate(zip(confs, tokens)):
        out[i, :] = np.log((1 - c) / (V - 1))
        out[i, t] = np.log(c)
    return out


def run(kind, confs, tokens, x, **kw):
    knobs = row_knobs(1, **{k: jnp.asarray([v], jnp.float32) for k, v in dict(
        temperature=0.0, low_threshold=kw.pop("low", 0.4), factor=kw.pop("factor", 1.0), credit_alpha=0.7,
        credit_gamma=0.2, credit_beta=0.8).items()})
    lg = jnp.asarray(logits_for(confs, tokens))[None]
    cand, transfer, _ = st.decide(kind, lg, jnp.asarray([x], jnp.int32), M, knobs,
                                  keys_B=jax.vmap(jax.random.key)(jnp.asarray([0], jnp.uint32)), step_B=jnp.asarray([kw.pop("step", 0)]),
                                  quota_B=jnp.asarray([kw.pop("quota", 0)]), tau_B=jnp.asarray([kw.pop("tau", 0.9)]),
                                  credit_BSV=jnp.zeros((1, len(x), 10)))
    return np.asarray(cand[0]), np.flatnonzero(np.asarray(transfer[0])).tolist()


def test_num_transfer_tokens_llada_split():
    got = [int(st.num_transfer_tokens(jnp.asarray(10), 4, jnp.asarray(i))) for i in range(4)]
    assert got == [3, 3, 2, 2] and sum(got) == 10
    assert [int(st.num_transfer_tokens(jnp.asarray(3), 8, jnp.asarray(i))) for i in range(8)] == [1, 1, 1, 0, 0, 0, 0, 0]


def test_fixed_top_k_with_ties_prefers_lower_position():
    _, t = run("fixed", [0.5, 0.7, 0.7, 0.7, 0.2], [1, 2, 3, 4, 5], [M, M, M, 0, M], quota=2)
    assert t == [1, 2]  # position 3 is not masked; the tie 1 vs 2 keeps both; quota 2


def test_threshold_all_below_takes_only_the_best():
    _, t = run("threshold", [0.3, 0.5, 0.4], [1, 2, 3], [M, M, M], tau=0.9)
    assert t == [1]


def test_threshold_unmasks_everything_above_tau():
    _, t = run("threshold", [0.95, 0.5, 0.97, 0.99], [1, 2, 3, 4], [M, M, M, 5], tau=0.9)
    assert t == [0, 2]  # 3 is decoded already


def test_threshold_never_emits_mask_token():
    cand, t = run("threshold", [0.99, 0.6], [M, 2], [M, M], tau=0.5)
    assert t == [1] and cand[1] == 2


def test_all_masked_predict_mask_falls_back_to_best_non_mask_token():
    cand, t = run("threshold", [0.99, 0.98], [M, M], [M, M], tau=0.5)
    assert t == [1] and cand[1] != M  # position 1 has the more probable non-mask token (0.02/9 > 0.01/9)


def test_factor_rule():
    # sorted confs 0.99, 0.8, 0.7, 0.6: n=2 needs >= 1 - 1/3 = .667 (ok), n=3 needs >= .75 (0.7 fails)
    _, t = run("factor", [0.6, 0.99, 0.8, 0.7], [1, 2, 3, 4], [M, M, M, M], factor=1.0)
    assert t == [1, 2]


def test_hierarchy_one_per_run_plus_threshold_plus_top():
    # runs of masks: [0,1,2] and [4,5]; winners 1 (0.6) and 5 (0.5 > low 0.4); 0.95 at 0 passes tau
    x = [M, M, M, 3, M, M]
    _, t = run("hierarchy", [0.95, 0.6, 0.3, 0.05, 0.2, 0.5], [1, 2, 3, 4, 5, 6], x, tau=0.9, low=0.4)
    assert t == [0, 5]  # run 1's winner is position 0 (0.95); run 2's winner 5
    _, t = run("hierarchy", [0.3, 0.35, 0.3, 0.05, 0.2, 0.1], [1, 2, 3, 4, 5, 6], x, tau=0.9, low=0.4)
    assert t == [1]  # nothing above low: only the global best


def test_credit_accumulates_on_stable_argmax():
    V, S = 10, 3
    lg = jnp.asarray(logits_for([0.5, 0.5, 0.5], [1, 2, 3]))[None]
    c = st.credit_update(jnp.zeros((1, S, V)), lg, jnp.asarray([[True, True, False]]), jnp.asarray([True]),
                         jnp.asarray([0.2]), jnp.asarray([0.8]))
    np.testing.assert_allclose(np.asarray(c)[0, 0, 1], 0.5 ** 0.2, rtol=1e-6)
    assert float(np.asarray(c)[0, 2].sum()) == 0.0  # decoded position gets no credit
    c2 = st.credit_update(c, lg, jnp.asarray([[True, True, False]]), jnp.asarray([False]), jnp.asarray([0.2]),
                          jnp.asarray([0.8]))
    np.testing.assert_allclose(np.asarray(c2)[0, 0, 1], 0.8 * 0.5 ** 0.2 + 0.5 ** 0.2, rtol=1e-6)


def test_gumbel_zero_temperature_is_argmax_and_positive_is_seeded():
    lg = jnp.asarray(np.random.RandomState(0).randn(1, 6, 10), jnp.float32)
    keys = jax.vmap(jax.random.key)(jnp.asarray([3], jnp.uint32))
    np.testing.assert_array_equal(st.gumbel_candidates(lg, jnp.asarray([0.0]), keys), np.argmax(lg, -1))
    a = st.gumbel_candidates(lg, jnp.asarray([5.0]), keys)
    b = st.gumbel_candidates(lg, jnp.asarray([5.0]), keys)
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, np.argmax(lg, -1))  # T=5 over 6 positions: noise changes some picks
