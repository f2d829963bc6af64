"""Training the demo model: task suite, character tokenizer, masked-diffusion objective, export."""
import json
import os

import numpy as np
import pytest

from dinfer_jax import tasks as T
from dinfer_jax.kernels import KernelConfig


@pytest.mark.smoke
def test_tasks_are_checkable_and_seeded():
    a, b = T.sample(200, seed=7), T.sample(200, seed=7)
    assert a == b and a != T.sample(200, seed=8)
    assert {p["task"] for p in a} == set(T.TASKS)
    for p in a:
        assert T.solve(p["prompt"]) == p["answer"] and T.task_of(p["prompt"]) == p["task"]
        assert len(p["prompt"]) <= T.max_prompt_chars() and len(p["answer"]) <= T.max_answer_chars()
    assert T.solve("add 999+001=") == "1000" and T.solve("add 123+45=") == "0168"
    assert T.solve("rev hello=") == "olleh" and "reverse" not in T.TASKS
    assert T.solve("sort 5391=") == "1359"
    assert T.solve("rev hello=") == "olleh"
    assert T.solve("next abcz=") == "bcda"
    for bad in ("mul 2*3=", "add 1+=", "rev Hello=", "sort 12a=", "next abc"):
        with pytest.raises(ValueError):
            T.solve(bad)


@pytest.mark.smoke
def test_char_tokenizer_roundtrip(tmp_path):
    from dinfer_jax.tokenizer import EOS_TOKEN, MASK_TOKEN, char_tokenizer, load_tokenizer
    char_tokenizer().save(str(tmp_path))
    tok = load_tokenizer(str(tmp_path))
    text = "add 12+345=\tRev: x y!"
    ids = tok.encode(text)
    assert len(ids) == len(text) and tok.decode(ids) == text
    eos, mask = tok.token_to_id(EOS_TOKEN), tok.token_to_id(MASK_TOKEN)
    assert (eos, mask) == (0, 1)
    assert tok.decode(ids + [eos, eos]) == text  # special tokens are skipped
    assert tok.encode("a" + EOS_TOKEN) == [tok.token_to_id("a"), eos]
    cfg = json.load(open(tmp_path / "tokenizer_config.json"))
    assert cfg["mask_token"] == MASK_TOKEN and cfg["eos_token"] == EOS_TOKEN


def test_encode_problems_layout():
    from dinfer_jax.tokenizer import char_tokenizer
    from dinfer_jax.train import encode_problems
    tok = char_tokenizer()
    toks, pads = encode_problems(tok, [{"prompt": "rev ab=", "answer": "ba"}], 8, 4, eos_id=0)
    assert pads.tolist() == [1]
    assert tok.decode(toks[0, 1:8]) == "rev ab=" and tok.decode(toks[0, 8:]) == "ba"
    assert toks[0, 0] == 0 and toks[0, 10:].tolist() == [0, 0]


def test_diffusion_loss_masks_only_answers():
    """Prompt tokens are never masked; the loss only sees masked answer tokens (weighted 1/t)."""
    import jax
    import jax.numpy as jnp
    from dinfer_jax.tokenizer import char_tokenizer
    from dinfer_jax.train import demo_config, diffusion_loss

    tok = char_tokenizer()
    cfg = demo_config(tok, hidden=32, layers=1, expert_ffn=16, heads=2, kv_heads=1)
    seen = {}

    class Spy:
        def apply(self, variables, x, positions_BS, key_mask_BL):
            seen.update(x=x, positions=positions_BS, key_mask=key_mask_BL)
            return jnp.zeros(x.shape + (cfg.vocab_size,)), None

    toks = jnp.asarray(np.random.RandomState(0).randint(3, 50, (64, 12)), jnp.int32)
    pads = jnp.full((64,), 2, jnp.int32)
    loss, m = diffusion_loss(Spy(), None, toks, pads, jax.random.key(0), prompt_len=8, mask_id=1)
    x = np.asarray(seen["x"])
    assert (x[:, :8] == np.asarray(toks)[:, :8]).all()  # prompt untouched
    assert 0.3 < (x[:, 8:] == 1).mean() < 0.7  # answers masked with t ~ U(0, 1)
    assert np.asarray(seen["key_mask"])[:, :2].sum() == 0 and np.asarray(seen["positions"])[0, 2] == 0
    assert np.isclose(float(m["masked_ce"]), np.log(cfg.vocab_size), rtol=1e-5)


def test_training_reduces_loss_and_exports(tmp_path):
    """A few jitted steps on a tiny config: the loss falls; the export loads with load_model."""
    from dinfer_jax import load_model
    from dinfer_jax.checkpoint import generation_defaults
    from dinfer_jax.tokenizer import load_tokenizer
    from dinfer_jax.train import train

    out, work = str(tmp_path / "model"), str(tmp_path / "work")
    r = train(out, steps=40, batch=16, lr=3e-3, warmup=5, workdir=work, eval_every=0, ckpt_every=20,
              log_every=5, model_kw=dict(hidden=32, layers=1, expert_ffn=16, heads=2, kv_heads=1), quiet=True)
    losses = [x["loss"] for x in r["log"] if "loss" in x]
    assert len(losses) == 8 and all(np.isfinite(losses))
    assert np.mean(losses[-2:]) < 0.7 * losses[0], losses
    assert os.path.isfile(os.path.join(work, "log.jsonl"))
    m = load_model(out)
    assert m.config == r["config"]
    assert load_tokenizer(out).encode("add 1+2=") and generation_defaults(out) == {"gen_length": 16,
                                                                                  "block_length": 16}
    assert json.load(open(os.path.join(out, "training.json")))["steps"] == 40
    # resume from the saved state at step 40 and continue to 45
    r2 = train(None, steps=45, batch=16, lr=3e-3, warmup=5, workdir=work, resume=True, eval_every=0,
               log_every=5, model_kw=dict(hidden=32, layers=1, expert_ffn=16, heads=2, kv_heads=1), quiet=True)
    assert [x["step"] for x in r2["log"] if "loss" in x][-2:] == [40, 45]


def test_block_diffusion_loss_equals_full_forward_reference():
    """The two-pass loss (clean cache + noised windows) equals a slow reference: per row and block,
    one full block-causal forward over the canvas with only that block noised (fp32, 1e-5 rel.).
    The clean-prefix layout and the mask set are checked against the module's rules directly."""
    import jax
    import jax.numpy as jnp
    from dinfer_jax.models import Transformer
    from dinfer_jax.tokenizer import char_tokenizer
    from dinfer_jax.train import block_diffusion_loss, block_windows, demo_block_config, encode_problems, init_params
    tok = char_tokenizer()
    Bs, G, P = 4, 8, 10
    cfg = demo_block_config(tok, Bs, hidden=32, layers=2, experts=8, expert_ffn=16, heads=4, kv_heads=2)
    params = init_params(cfg, seed=3)
    module = Transformer(cfg, kernels=KernelConfig(experts="dense"))
    probs = [{"prompt": "sort 3141=", "answer": "1134"}, {"prompt": "next ab=", "answer": "bc"},
             {"prompt": "add 1+2=", "answer": "0003"}]
    toks, pads = encode_problems(tok, probs, P, G, eos_id=cfg.eos_token_id, tail=Bs)
    key = jax.random.key(5)
    loss, _ = block_diffusion_loss(module, params, jnp.asarray(toks), jnp.asarray(pads), key, P, G, Bs,
                                   cfg.mask_token_id)
    w = jax.tree_util.tree_map(np.asarray, block_windows(jnp.asarray(toks), jnp.asarray(pads), key, P, G, Bs,
                                                         cfg.mask_token_id))
    B, L = toks.shape
    NB = w["x_WS"].shape[0] // B
    total, seen = 0.0, 0
    for b in range(B):
        p_len = P - pads[b]
        end = -(-(p_len + G) // Bs) * Bs
        for j in range(NB):
            i, s = b * NB + j, int(w["start_W"][b * NB + j])
            blk = p_len // Bs + j
            if blk * Bs >= end:
                assert not w["masked_WS"][i].any()
                continue
            assert s == pads[b] + blk * Bs and (w["pos_WS"][i] == np.arange(blk * Bs, blk * Bs + Bs)).all()
            np.testing.assert_array_equal(w["clean_WS"][i], toks[b, s:s + Bs])
            gen = np.arange(blk * Bs, blk * Bs + Bs) >= p_len
            assert not (w["masked_WS"][i] & ~gen).any()  # prompt positions are never masked
            canvas = toks[b].copy()
            canvas[s:s + Bs] = w["x_WS"][i]
            canvas[s + Bs:] = cfg.mask_token_id  # later blocks are invisible to this one: any content
            idx = np.arange(L)
            logits, _ = module.apply({"params": params}, jnp.asarray(canvas[None]),
                                     positions_BS=jnp.asarray(np.maximum(idx - pads[b], 0)[None]),
                                     key_mask_BL=jnp.asarray((idx >= pads[b])[None]))
            logp = jax.nn.log_softmax(np.asarray(logits[0, s:s + Bs], np.float64), axis=-1)
            ce = -np.take_along_axis(np.asarray(logp), toks[b, s:s + Bs, None], axis=-1)[:, 0]
            total += float(np.sum(ce * w["masked_WS"][i]) / w["t_W"][i])
            seen += int(w["masked_WS"][i].sum())
    assert seen > 0
    np.testing.assert_allclose(float(loss), total / (B * G), rtol=1e-5)
