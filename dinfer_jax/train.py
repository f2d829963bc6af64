"""Train a small demo dLLM on the demo task suite: a LLaDA-MoE with LLaDA's masked-diffusion
objective, or (--block-size B) a LLaDA2 block-diffusion model with the block-diffusion objective.

  python -m dinfer_jax.train --out DIR [--steps N] [--batch B] [--lr LR] [--workdir W] [--resume]
  python -m dinfer_jax.train --block-size 4 --out DIR ...   (the block-diffusion demo model)
  (also `dinfer-jax train ...`)

DIR gets a dinfer-jax checkpoint (bf16 params, tokenizer, decoding defaults, training.json);
WORKDIR orbax training states (--resume), log.jsonl, loss.png. The objectives:
docs/internals/demo_model.md.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from dinfer_jax import tasks as T
from dinfer_jax.config import ModelConfig
from dinfer_jax.families import to_hf_dict
from dinfer_jax.kernels import KernelConfig
from dinfer_jax.tokenizer import EOS_TOKEN, MASK_TOKEN, Tokenizer, char_tokenizer

# Decoding defaults stored with the demo model (the region it was trained to answer in).
GEN_LENGTH, BLOCK_LENGTH = 16, 16
# Task weights of the training mix: addition and sorting take longest to learn, `next` is learned early.
DEFAULT_MIX = {"add": 2.0, "sort": 1.5, "next": 0.5}


def demo_config(tok: Tokenizer, hidden: int = 256, layers: int = 4, experts: int = 8, top_k: int = 2,
                expert_ffn: int = 64, heads: int = 8, kv_heads: int = 4) -> ModelConfig:
    """The demo model: LLaDA-MoE architecture (q/k RMSNorm, GQA, softmax top-k router, SwiGLU experts)."""
    return ModelConfig(
        family="llada_moe", vocab_size=tok.vocab_size, hidden_size=hidden, num_layers=layers, num_heads=heads,
        num_kv_heads=kv_heads, head_dim=hidden // heads, intermediate_size=expert_ffn, rope_theta=10000.0,
        qk_norm=True, num_experts=experts, num_experts_per_tok=top_k, max_position_embeddings=512,
        mask_token_id=tok.token_to_id(MASK_TOKEN), eos_token_id=tok.token_to_id(EOS_TOKEN),
        pad_token_id=tok.token_to_id(EOS_TOKEN))


def demo_block_config(tok: Tokenizer, block_size: int = 4, hidden: int = 256, layers: int = 4, experts: int = 8,
                      top_k: int = 2, expert_ffn: int = 64, heads: int = 8, kv_heads: int = 4) -> ModelConfig:
    """The block-diffusion demo model: LLaDA2 architecture (sigmoid group-limited router with expert
    bias, one shared expert, a leading dense layer, q/k RMSNorm, GQA, block-causal attention)."""
    return ModelConfig(
        family="llada2", vocab_size=tok.vocab_size, hidden_size=hidden, num_layers=layers, num_heads=heads,
        num_kv_heads=kv_heads, head_dim=hidden // heads, intermediate_size=expert_ffn, rope_theta=10000.0,
        qk_norm=True, num_experts=experts, num_experts_per_tok=top_k, norm_topk_prob=True, router="sigmoid_group",
        n_group=4, topk_group=2, routed_scaling_factor=2.5, num_shared_experts=1, first_k_dense=1,
        dense_intermediate_size=hidden, attention_mask="block_causal", block_size=block_size,
        max_position_embeddings=512, mask_token_id=tok.token_to_id(MASK_TOKEN),
        eos_token_id=tok.token_to_id(EOS_TOKEN), pad_token_id=tok.token_to_id(EOS_TOKEN))


class Batcher:
    """Fresh task problems -> (tokens (B, P+G) int32, pads (B,) int32). Prompts right-aligned at P."""

    def __init__(self, tok: Tokenizer, batch: int, prompt_len: int, gen_length: int, seed: int, eos_id: int,
                 mix: dict | None = None, tail: int = 0):
        self.tok, self.B, self.P, self.G, self.eos, self.mix = tok, batch, prompt_len, gen_length, eos_id, mix
        self.tail = tail
        self.rng = random.Random(seed)

    def __call__(self):
        probs = T.sample(self.B, seed=self.rng.getrandbits(63), weights=self.mix)
        return encode_problems(self.tok, probs, self.P, self.G, self.eos, self.tail)


def encode_problems(tok, probs, P: int, G: int, eos_id: int, tail: int = 0):
    """-> tokens (B, P + G + tail) [pads | prompt | answer | EOS ...], pads (B,). The tail (EOS) holds
    the rest of the last block a block-diffusion model decodes past the generation region."""
    prompts = tok.encode_batch([p["prompt"] for p in probs])
    answers = tok.encode_batch([p["answer"] for p in probs])
    toks = np.full((len(probs), P + G + tail), eos_id, np.int32)
    pads = np.zeros((len(probs),), np.int32)
    for i, (p, a) in enumerate(zip(prompts, answers)):
        if len(p) > P or len(a) > G:
            raise ValueError(f"problem {probs[i]['prompt']!r} does not fit prompt {P} / answer {G} tokens")
        toks[i, P - len(p):P] = p
        toks[i, P:P + len(a)] = a
        pads[i] = P - len(p)
    return toks, pads


def diffusion_loss(module, params, tokens_BL, pads_B, key, prompt_len: int, mask_id: int, eps: float = 1e-3):
    """LLaDA masked-diffusion loss on the answer region [prompt_len, L). Returns (loss, metrics)."""
    B, L = tokens_BL.shape
    k_t, k_m = jax.random.split(key)
    t_B = (jnp.arange(B) + jax.random.uniform(k_t, ())) / B  # stratified t ~ U(0, 1)
    t_B = eps + (1 - eps) * t_B
    idx_L = jnp.arange(L)
    in_answer = (idx_L >= prompt_len)[None, :]
    masked_BL = (jax.random.uniform(k_m, (B, L)) < t_B[:, None]) & in_answer
    x_BL = jnp.where(masked_BL, mask_id, tokens_BL)
    positions = jnp.maximum(idx_L[None, :] - pads_B[:, None], 0)
    key_mask = idx_L[None, :] >= pads_B[:, None]
    logits, _ = module.apply({"params": params}, x_BL, positions_BS=positions, key_mask_BL=key_mask)
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    ce_BL = -jnp.take_along_axis(logp, tokens_BL[..., None], axis=-1)[..., 0]
    m = masked_BL.astype(jnp.float32)
    G = L - prompt_len
    loss = jnp.sum(ce_BL * m / t_B[:, None]) / (B * G)
    n = jnp.maximum(jnp.sum(m), 1.0)
    acc = jnp.sum((jnp.argmax(logits, -1) == tokens_BL) * m) / n
    return loss, {"loss": loss, "masked_ce": jnp.sum(ce_BL * m) / n, "masked_acc": acc}


def block_diffusion_loss(module, params, tokens_BL, pads_B, key, prompt_len: int, gen_length: int,
                         block_size: int, mask_id: int, eps: float = 1e-3):
    """Block-diffusion loss (docs/internals/demo_model.md) -> (loss, metrics). tokens_BL: [pads | prompt
    | answer, EOS...], every prompt ending at prompt_len, L >= prompt_len + gen_length + block_size."""
    B, L = tokens_BL.shape
    w = block_windows(tokens_BL, pads_B, key, prompt_len, gen_length, block_size, mask_id, eps)
    NB = w["x_WS"].shape[0] // B
    idx_L = jnp.arange(L)
    positions_BL = jnp.maximum(idx_L[None, :] - pads_B[:, None], 0)
    key_mask_BL = idx_L[None, :] >= pads_B[:, None]
    _, kv = module.apply({"params": params}, tokens_BL, positions_BS=positions_BL, key_mask_BL=key_mask_BL)
    rep = lambda a: jnp.repeat(a, NB, axis=0)  # noqa: E731  row b's windows are rows b*NB .. b*NB+NB-1
    kv_W = tuple(jnp.repeat(a, NB, axis=1) for a in kv)
    logits, _ = module.apply({"params": params}, w["x_WS"], positions_BS=w["pos_WS"],
                             key_mask_BL=rep(key_mask_BL), kv=kv_W, window_start=w["start_W"],
                             key_positions_BL=rep(positions_BL))
    clean_WS, masked_WS, t_W = w["clean_WS"], w["masked_WS"], w["t_W"]
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    ce_WS = -jnp.take_along_axis(logp, clean_WS[..., None], axis=-1)[..., 0]
    m = masked_WS.astype(jnp.float32)
    loss = jnp.sum(ce_WS * m / t_W[:, None]) / (B * gen_length)
    n = jnp.maximum(jnp.sum(m), 1.0)
    acc = jnp.sum((jnp.argmax(logits, -1) == clean_WS) * m) / n
    return loss, {"loss": loss, "masked_ce": jnp.sum(ce_WS * m) / n, "masked_acc": acc}


def block_windows(tokens_BL, pads_B, key, prompt_len: int, gen_length: int, block_size: int, mask_id: int,
                  eps: float = 1e-3) -> dict:
    """The noised blocks of `block_diffusion_loss`: W = B * NB windows of S = block_size tokens (row
    b's are b*NB .. b*NB+NB-1, NB = ceil(G / S) + 1; windows past a row's generation region carry no
    masks). -> {x_WS (noised), clean_WS, masked_WS, t_W, start_W (canvas index), pos_WS (positions)}."""
    B, L = tokens_BL.shape
    Bs, G = block_size, gen_length
    NB = -(-G // Bs) + 1  # most blocks a generation region of G tokens can touch
    k_t, k_p, k_m = jax.random.split(key, 3)
    P_B = prompt_len - pads_B  # each row's prompt length
    blk_BN = P_B[:, None] // Bs + jnp.arange(NB)[None, :]  # blocks from the one holding position P
    end_B = -(-(P_B + G) // Bs) * Bs  # the generation region ends at a block boundary
    valid_BN = blk_BN * Bs < end_B[:, None]
    start_BN = jnp.minimum(pads_B[:, None] + blk_BN * Bs, L - Bs)  # invalid windows: clipped, weight 0
    pos_BNS = blk_BN[..., None] * Bs + jnp.arange(Bs)
    clean_BNS = jnp.take_along_axis(tokens_BL[:, None, :], (start_BN[..., None] + jnp.arange(Bs)), axis=2)
    gen_BNS = (pos_BNS >= P_B[:, None, None]) & valid_BN[..., None]
    W = B * NB
    t_W = eps + (1 - eps) * (jnp.arange(W) + jax.random.uniform(k_t, ())) / W  # stratified over windows
    t_W = jax.random.permutation(k_p, t_W)
    masked_WS = (jax.random.uniform(k_m, (W, Bs)) < t_W[:, None]) & gen_BNS.reshape(W, Bs)
    clean_WS = clean_BNS.reshape(W, Bs)
    x_WS = jnp.where(masked_WS, mask_id, clean_WS)
    return {"x_WS": x_WS, "clean_WS": clean_WS, "masked_WS": masked_WS, "t_W": t_W,
            "start_W": start_BN.reshape(W), "pos_WS": pos_BNS.reshape(W, Bs)}


def init_params(cfg: ModelConfig, seed: int = 0) -> dict:
    """Random initial params from the model's abstract shapes (no compile; scales: docs/internals/demo_model.md)."""
    from dinfer_jax.models import abstract_params, unflatten
    rng = np.random.default_rng(seed)
    flat = {}
    for path, sds in sorted(abstract_params(cfg).items()):
        if path.endswith("/scale"):
            flat[path] = np.ones(sds.shape, np.float32)
        else:
            std = 0.02 / np.sqrt(2 * cfg.num_layers) if path.endswith(("o_proj", "down_proj")) else 0.02
            flat[path] = (rng.standard_normal(sds.shape) * std).astype(np.float32)
        if path.endswith("router_bias"):  # selection-only bias: no gradient reaches it; balanced at 0
            flat[path] = np.zeros(sds.shape, np.float32)
    return jax.tree_util.tree_map(jnp.asarray, unflatten(flat))


def make_optimizer(lr: float, steps: int, warmup: int, weight_decay: float = 0.01):
    import optax
    sched = optax.warmup_cosine_decay_schedule(0.0, lr, max(1, warmup), max(steps, warmup + 1), end_value=lr * 0.05)
    # no weight decay on norm scales
    wd_mask = lambda p: jax.tree_util.tree_map_with_path(  # noqa: E731
        lambda path, _: not any(getattr(k, "key", "") == "scale" for k in path), p)
    return optax.chain(optax.clip_by_global_norm(1.0),
                       optax.adamw(sched, b1=0.9, b2=0.98, weight_decay=weight_decay, mask=wd_mask)), sched


def make_train_step(module, opt, prompt_len: int, mask_id: int, block_size: int = 0, gen_length: int = 0):
    import optax

    def loss_fn(p, tokens, pads, key):
        if block_size:
            return block_diffusion_loss(module, p, tokens, pads, key, prompt_len, gen_length, block_size, mask_id)
        return diffusion_loss(module, p, tokens, pads, key, prompt_len, mask_id)

    @jax.jit
    def step(params, opt_state, tokens, pads, key):
        (_, metrics), grads = jax.value_and_grad(lambda p: loss_fn(p, tokens, pads, key), has_aux=True)(params)
        updates, opt_state = opt.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        metrics["grad_norm"] = optax.global_norm(grads)
        return params, opt_state, metrics
    return step


def one_token_per_step(cfg: ModelConfig):
    """The baseline decoding of a demo model: one token per forward (fixed schedule; block models:
    the block loop with the threshold out of reach, so each step unmasks its single most probable)."""
    from dinfer_jax.engine import SamplingParams
    if cfg.attention_mask == "block_causal":
        return SamplingParams(gen_length=GEN_LENGTH, block_length=cfg.block_size, strategy="threshold",
                              threshold=1.0, cache="block")
    return SamplingParams(gen_length=GEN_LENGTH, block_length=BLOCK_LENGTH, strategy="fixed", steps=GEN_LENGTH,
                          cache="none")


def evaluate_tasks(model, tok, n: int, seed: int, sp=None):
    """Exact-match accuracy of `model` on n fresh problems (default: one token per step)."""
    from dinfer_jax.engine import generate
    sp = sp or one_token_per_step(model.config)
    probs = T.sample(n, seed=seed)
    res = generate(model, [np.asarray(ids, np.int32) for ids in tok.encode_batch([p["prompt"] for p in probs])], sp)
    outs = [tok.decode(ids) for ids in res.token_ids]
    return float(np.mean([o == p["answer"] for o, p in zip(outs, probs)])), outs, probs, res


def plot_loss(log: list[dict], path: str, title: str = "demo model training") -> bool:
    """Loss curve (raw + EMA) as a PNG; False when matplotlib is not installed."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    steps = [r["step"] for r in log if "loss" in r]
    loss = [r["loss"] for r in log if "loss" in r]
    ema, e = [], None  # each logged loss is already a mean over log_every steps
    for v in loss:
        e = v if e is None else 0.7 * e + 0.3 * v
        ema.append(e)
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, loss, lw=0.6, alpha=0.5, label="loss (mean per log interval)")
    ax.plot(steps, ema, lw=1.5, label="loss (EMA 0.7)")
    ev = [r for r in log if "eval_acc" in r]
    if ev:
        ax2 = ax.twinx()
        ax2.plot([r["step"] for r in ev], [r["eval_acc"] for r in ev], "o-", color="C2", label="exact match (fixed)")
        ax2.set_ylim(0, 1.02)
        ax2.set_ylabel("exact match, one token per step")
        ax2.legend(loc="lower right")
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("masked-diffusion loss (1/t weighted)")
    ax.set_title(title)
    ax.legend(loc="lower left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def export(out: str, params, cfg: ModelConfig, tok: Tokenizer, record: dict, dtype: str = "bfloat16"):
    """Write a dinfer-jax checkpoint (params cast to `dtype`) + tokenizer + decoding defaults."""
    import ml_dtypes
    from dinfer_jax.checkpoint import save_params
    np_dtype = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(dtype)
    host = jax.tree_util.tree_map(lambda a: np.asarray(a).astype(np_dtype), params)
    save_params(out, host, to_hf_dict(cfg))
    tok.save(out)
    with open(os.path.join(out, "generation_config.json"), "w") as f:
        json.dump({"mask_token_id": cfg.mask_token_id, "eos_token_id": cfg.eos_token_id,
                   "pad_token_id": cfg.pad_token_id,
                   "dinfer_jax": {"gen_length": GEN_LENGTH,
                                  "block_length": cfg.block_size if cfg.block_size else BLOCK_LENGTH}}, f, indent=1)
    with open(os.path.join(out, "training.json"), "w") as f:
        json.dump(record, f, indent=1)


def folder_bytes(folder: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(folder) for f in fs)


def train(out: str | None, steps: int = 3000, batch: int = 64, lr: float = 2e-3, warmup: int = 100,
          seed: int = 0, workdir: str | None = None, resume: bool = False, eval_every: int = 250,
          eval_n: int = 128, ckpt_every: int = 500, log_every: int = 25, moe_impl: str = "dense",
          model_kw: dict | None = None, mix: dict | None = None, argv: list[str] | None = None,
          quiet: bool = False, block_size: int = 0) -> dict:
    """Run training; returns {"log": [...], "params": ..., "config": ..., "seconds": ...}."""
    import optax  # noqa: F401  (fail early when missing)
    from dinfer_jax.model import Model
    from dinfer_jax.models import Transformer

    say = (lambda *a: None) if quiet else (lambda *a: print(*a, flush=True))
    tok = char_tokenizer()
    if block_size < 0 or (block_size and GEN_LENGTH % block_size):
        raise ValueError(f"--block-size must divide the generation length {GEN_LENGTH}, got {block_size}")
    cfg = (demo_block_config(tok, block_size, **(model_kw or {})) if block_size
           else demo_config(tok, **(model_kw or {})))
    P = -(-T.max_prompt_chars() // 4) * 4
    G = GEN_LENGTH
    if T.max_answer_chars() >= G:
        raise ValueError("answers must leave room for at least one EOS in the generation region")
    module = Transformer(cfg, kernels=KernelConfig(experts=moe_impl))
    params = init_params(cfg, seed)
    opt, sched = make_optimizer(lr, steps, warmup)
    opt_state = opt.init(params)
    step_fn = make_train_step(module, opt, P, cfg.mask_token_id, block_size, G)
    n_params = sum(int(np.prod(a.shape)) for a in jax.tree_util.tree_leaves(params))
    kind = f"LLaDA2 block diffusion (block {block_size})" if block_size else "LLaDA-MoE"
    say(f"demo {kind}: {n_params:,} params ({cfg.num_layers} layers, D {cfg.hidden_size}, {cfg.num_experts} "
        f"experts top-{cfg.num_experts_per_tok}, F {cfg.intermediate_size}, V {cfg.vocab_size}); "
        f"batch {batch} x (prompt {P} + answer {G}); {steps} steps; jax {jax.__version__} {jax.default_backend()}")

    mngr, start, log = None, 0, []
    if workdir:
        import orbax.checkpoint as ocp
        os.makedirs(workdir, exist_ok=True)
        mngr = ocp.CheckpointManager(os.path.abspath(os.path.join(workdir, "state")),
                                     options=ocp.CheckpointManagerOptions(max_to_keep=2))
        if resume and mngr.latest_step() is not None:
            start = int(mngr.latest_step())
            try:
                restored = mngr.restore(start, args=ocp.args.StandardRestore({"params": params, "opt": opt_state}))
            except (ValueError, KeyError) as e:
                raise ValueError(f"{workdir}: cannot resume from step {start}: the saved state does not match this "
                                 f"model's params (a workdir saved before checkpoint format v2 holds the LM head as "
                                 f"lm_head/kernel (D, V); start a fresh --workdir)") from e
            params, opt_state = restored["params"], restored["opt"]
            log_path = os.path.join(workdir, "log.jsonl")
            if os.path.isfile(log_path):
                with open(log_path) as f:
                    log = [r for r in map(json.loads, f) if r["step"] <= start]
            say(f"resumed from step {start}")
        with open(os.path.join(workdir, "log.jsonl"), "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in log)

    eval_model = Model(cfg, params)
    mix = dict(DEFAULT_MIX if mix is None else mix)
    batcher = Batcher(tok, batch, P, G, seed=seed * 1000003 + start, eos_id=cfg.eos_token_id, mix=mix,
                      tail=block_size)
    key = jax.random.key(seed)
    t0 = time.perf_counter() - (log[-1]["seconds"] if log else 0.0)

    def record(r):
        log.append(r)
        if workdir:
            with open(os.path.join(workdir, "log.jsonl"), "a") as f:
                f.write(json.dumps(r) + "\n")

    def run_eval(s):
        eval_model.params = params
        acc, *_ = evaluate_tasks(eval_model, tok, eval_n, seed=10**9 + s)
        record({"step": s, "eval_acc": acc, "seconds": round(time.perf_counter() - t0, 2)})
        say(f"step {s}: exact match (one token per step, {eval_n} fresh problems) {acc:.3f}")

    acc_loss = []
    for s in range(start + 1, steps + 1):
        tokens, pads = batcher()
        params, opt_state, m = step_fn(params, opt_state, tokens, pads, jax.random.fold_in(key, s))
        acc_loss.append(m)
        if s % log_every == 0 or s == steps:
            m = jax.tree_util.tree_map(lambda *v: float(np.mean(v)), *acc_loss)
            acc_loss = []
            r = {"step": s, **{k: round(v, 5) for k, v in m.items()}, "lr": float(sched(s)),
                 "seconds": round(time.perf_counter() - t0, 2)}
            record(r)
            say(f"step {s}: loss {r['loss']:.4f} masked acc {r['masked_acc']:.3f} grad {r['grad_norm']:.2f} "
                f"lr {r['lr']:.2e} ({r['seconds']:.0f}s)")
        if eval_every and (s % eval_every == 0 or s == steps):
            run_eval(s)
        if mngr is not None and (s % ckpt_every == 0 or s == steps):
            import orbax.checkpoint as ocp
            mngr.save(s, args=ocp.args.StandardSave({"params": params, "opt": opt_state}))
    if mngr is not None:
        mngr.wait_until_finished()
    seconds = time.perf_counter() - t0
    cpu = os.times()
    losses = [r["loss"] for r in log if "loss" in r]
    final_loss = float(np.mean(losses[-4:])) if losses else float("nan")
    evals = [r["eval_acc"] for r in log if "eval_acc" in r]
    rec = {"command": "python -m dinfer_jax.train " + " ".join(argv or []), "steps": steps, "batch": batch,
           "lr": lr, "warmup": warmup, "seed": seed, "prompt_len": P, "gen_length": G, "seconds": round(seconds, 1),
           "process_cpu_seconds": round(cpu.user + cpu.system, 1), "cpus": os.cpu_count(),
           "final_loss": round(final_loss, 5), "final_eval_acc": evals[-1] if evals else None,
           "jax": jax.__version__, "params": n_params, "mix": mix,
           "objective": f"block diffusion, block {block_size}" if block_size else "masked diffusion (LLaDA)"}
    if workdir and plot_loss(log, os.path.join(workdir, "loss.png")):
        say(f"loss curve: {os.path.join(workdir, 'loss.png')}")
    if out:
        export(out, params, cfg, tok, rec)
        say(f"wrote {out} ({folder_bytes(out) / 2**20:.2f} MiB)")
    say(f"done: {steps} steps in {seconds:.0f}s, final loss {final_loss:.4f}")
    return {"log": log, "params": params, "config": cfg, "seconds": seconds, "record": rec, "tokenizer": tok}


def _parse_mix(text: str) -> dict:
    try:
        mix = {k.strip(): float(v) for k, v in (item.split("=") for item in text.split(",") if item.strip())}
    except ValueError:
        raise argparse.ArgumentTypeError(f"--mix must look like add=2,sort=1,next=1, got {text!r}") from None
    bad = set(mix) - set(T.ALL_TASKS)
    if bad or not mix or min(mix.values()) < 0 or not sum(mix.values()) > 0:
        raise argparse.ArgumentTypeError(f"--mix: tasks must be among {T.ALL_TASKS} with weights >= 0, got {text!r}")
    return mix


def build_parser(p: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    p = p or argparse.ArgumentParser(prog="python -m dinfer_jax.train", description=__doc__.split("\n")[0])
    p.add_argument("--out", default=None, help="write the trained model here (a dinfer-jax checkpoint folder)")
    p.add_argument("--workdir", default=None, help="training state checkpoints, log.jsonl, loss.png")
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eval-every", type=int, default=250)
    p.add_argument("--ckpt-every", type=int, default=500)
    p.add_argument("--resume", action="store_true", help="continue from the latest state in --workdir")
    p.add_argument("--moe-impl", default="dense", choices=("dense", "tiled", "ragged"),
                   help="expert computation used for training (dense is fastest to differentiate on CPU)")
    p.add_argument("--mix", type=_parse_mix, default=None,
                   help="task weights, e.g. add=2,sort=1,next=1 (default: add=2,sort=1.5,next=0.5)")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--expert-ffn", type=int, default=64)
    p.add_argument("--block-size", type=int, default=0,
                   help="> 0: train a LLaDA2 block-diffusion model with this block size (block-diffusion "
                        "objective); 0: a LLaDA-MoE with LLaDA's objective (default)")
    return p


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    a = build_parser().parse_args(argv)
    if a.out and os.path.exists(a.out) and os.listdir(a.out):
        raise SystemExit(f"--out {a.out} exists and is not empty")
    train(a.out, steps=a.steps, batch=a.batch, lr=a.lr, warmup=a.warmup, seed=a.seed, workdir=a.workdir,
          resume=a.resume, eval_every=a.eval_every, ckpt_every=a.ckpt_every, moe_impl=a.moe_impl,
          model_kw=dict(hidden=a.hidden, layers=a.layers, expert_ffn=a.expert_ffn), mix=a.mix, argv=argv,
          block_size=a.block_size)


if __name__ == "__main__":
    main()
