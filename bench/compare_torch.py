"""dinfer-jax vs a PyTorch peer on the same weights: identical tokens, tokens/s of each, the ratio.

  python bench/compare_torch.py                                   # the built-in demo model, demo-task prompts
  python bench/compare_torch.py --model demo --gen-length 32 --block-length 16
  python bench/compare_torch.py --model DIR                       # any LLaDA-MoE / LLaDA folder (HF or dinfer-jax)
  python bench/compare_torch.py --random-preset llada-moe-7b-a1b --layers 1 --prompt-len 64 \
      --gen-length 64 --block-length 32 --out bench/compare_torch.json

What runs (fp32 on CPU, `--threads` cores for both sides, batch 1, one prompt at a time):
- (a) dinfer-jax: `Generator.generate` with SamplingParams, compiled by an untimed warm-up round.
- (b) the peer: the `transformers` model of the same architecture (LLaDA-MoE -> Qwen3MoeForCausalLM,
  LLaDA -> LlamaForCausalLM), loaded with `from_pretrained` from the Hugging Face folder written by
  our exporter (`converters.export`), run bidirectionally (a 4-D all-zero additive attention mask,
  as tests/hf_reference.py does), driven by a plain host loop under torch.inference_mode:
    fixed      LLaDA low-confidence remasking, `steps` split evenly over the blocks, no cache: one
               full forward (HF model call, logits for the block only) per step;
    threshold  dInfer/Fast-dLLM threshold (tau 0.9) with the dual cache: on block entry one full
               forward (HF model call, use_cache=True) gives every layer's K/V and decodes; every
               later step forwards only the block's tokens through the HF layers' own submodules,
               attending to the cached K/V with the block's positions replaced by the fresh K/V
               (used for that step only; only block-entry refreshes persist, as in dInfer).
  Both stop early as ours does: after a block completes with EOS in it, everything after it is EOS.
- Each timing round runs every prompt on both sides, the order alternating per round; the table
  reports the median round. Tokens must be identical (raises with the first differing position)
  and so must the number of forwards (NFE).

Checkpoints: `--model demo` (default) is dinfer_jax/demo_model with real prompts from the demo task
suite and its tokenizer; `--model DIR` converts an HF folder to a dinfer-jax checkpoint first; with
`--random-preset NAME [--layers N]` the weights are random (init_params' normal(0, 0.02), norms 1;
numpy seed 0) with the LM head scaled by `--head-scale` (default x40, as bench/bench_loop.py) so the
threshold strategy unmasks several tokens per forward instead of ~1. In every case both sides read the same files: dinfer-jax
loads the checkpoint, transformers loads its export. Threads: the process is pinned to the first
`--threads` CPUs (XLA's CPU thread pool follows the affinity mask; it would use every core otherwise)
and torch.set_num_threads(--threads).
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


def pin_threads(n: int):
    """Restrict this process to n CPUs (call before jax/torch create their thread pools)."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) > n:
        os.sched_setaffinity(0, cpus[:n])
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[var] = str(n)


# ---------------------------------------------------------------------------------------------
# Settings


@dataclasses.dataclass(frozen=True)
class Setting:
    """One table row: a strategy with its cache (fixed -> none, threshold -> dual)."""
    strategy: str
    gen_length: int
    block_length: int
    steps: int  # fixed only: total steps over all blocks
    threshold: float

    @property
    def cache(self) -> str:
        return {"fixed": "none", "threshold": "dual"}[self.strategy]

    @property
    def steps_per_block(self) -> int:
        return self.steps // (self.gen_length // self.block_length)

    def label(self) -> str:
        knob = f"steps {self.steps}" if self.strategy == "fixed" else f"tau {self.threshold:g}"
        return f"gen {self.gen_length} / block {self.block_length}, {knob}"

    def sampling_params(self):
        from dinfer_jax import SamplingParams
        return SamplingParams(gen_length=self.gen_length, block_length=self.block_length, strategy=self.strategy,
                              cache=self.cache, steps=self.steps if self.strategy == "fixed" else None,
                              threshold=self.threshold, temperature=0.0)


# ---------------------------------------------------------------------------------------------
# Checkpoint and prompts (both sides read the same files)


def random_prompts(cfg, n: int, length: int, seed: int = 0) -> list[list[int]]:
    import numpy as np
    specials = {cfg.mask_token_id, cfg.eos_token_id, cfg.pad_token_id, cfg.eot_token_id}
    allowed = np.array([i for i in range(cfg.vocab_size) if i not in specials])
    rng = np.random.RandomState(seed)
    return [rng.choice(allowed, length).tolist() for _ in range(n)]


def demo_prompts(folder: str, n: int, seed: int) -> list[list[int]]:
    """Fresh demo-task problems tokenized as dinfer_jax/evaluate.py does."""
    from dinfer_jax import tasks
    from dinfer_jax.tokenizer import load_tokenizer
    return load_tokenizer(folder).encode_batch([p["prompt"] for p in tasks.sample(n, seed=seed)])


def random_params(cfg, seed: int) -> dict:
    """Flat params with init_params' shapes and distribution (normal(0, 0.02); norm scales 1), drawn
    with numpy (init_params runs the model eagerly, which takes seconds even at tiny shapes)."""
    import jax
    import numpy as np
    from dinfer_jax.models import flatten, init_params
    shapes = flatten(jax.eval_shape(lambda: init_params(cfg, seed)))
    rng = np.random.default_rng(seed)
    def draw(k, shape):  # the LM head as the v1 (D, V) kernel, transposed: the same model as before format v2
        return np.ascontiguousarray(rng.standard_normal(shape[::-1], np.float32).T) if k.endswith("unembedding") else \
            rng.standard_normal(shape, np.float32)
    return {k: (np.ones(v.shape, np.float32) if k.endswith("scale")
                else draw(k, v.shape) * np.float32(0.02)) for k, v in shapes.items()}


def prepare_checkpoint(args, work: str) -> tuple[str, str]:
    """-> (dinfer-jax checkpoint folder, description of the weights)."""
    from dinfer_jax import checkpoint as ckpt
    if args.random_preset:
        from dinfer_jax import preset
        from dinfer_jax.families import to_hf_dict
        cfg = preset(args.random_preset)
        if args.layers:
            cfg = cfg.replace(num_layers=args.layers)
        params = random_params(cfg, seed=0)
        params["lm_head/unembedding"] *= args.head_scale
        dst = os.path.join(work, "ckpt")
        ckpt.save_params(dst, params, to_hf_dict(cfg))
        return dst, (f"random {args.random_preset} ({cfg.num_layers} layers): normal(0, 0.02), norms 1, "
                     f"LM head x{args.head_scale:g}")
    src = ckpt.model_path(args.model)
    if ckpt.is_checkpoint(src):
        return src, f"checkpoint {args.model}"
    from converters import convert
    dst = os.path.join(work, "ckpt")
    convert(src, dst, progress=False)
    return dst, f"HF folder {args.model} (converted)"


def make_prompts(args, folder: str, cfg) -> tuple[list[list[int]], str]:
    if args.model == "demo" and not args.random_preset:
        return demo_prompts(folder, args.num_prompts, args.seed), f"{args.num_prompts} demo-task prompts"
    if args.prompt:
        from dinfer_jax.tokenizer import load_tokenizer
        return load_tokenizer(folder).encode_batch(args.prompt), f"{len(args.prompt)} given prompts"
    return (random_prompts(cfg, args.num_prompts, args.prompt_len, args.seed),
            f"{args.num_prompts} random prompts of {args.prompt_len} tokens")


# ---------------------------------------------------------------------------------------------
# The PyTorch peer


# LLaDA dense HF names -> Llama names (regexes for from_pretrained's key_mapping; one group each:
# transformers joins the patterns into one alternation, so only \1 is safe).
LLADA_TO_LLAMA = {
    r"^model\.transformer\.wte\.": "model.embed_tokens.",
    r"^model\.transformer\.ln_f\.": "model.norm.",
    r"^model\.transformer\.ff_out\.": "lm_head.",
    r"^model\.transformer\.blocks\.(\d+)\.attn_norm\.": r"model.layers.\1.input_layernorm.",
    r"^model\.transformer\.blocks\.(\d+)\.ff_norm\.": r"model.layers.\1.post_attention_layernorm.",
    r"^model\.transformer\.blocks\.(\d+)\.q_proj\.": r"model.layers.\1.self_attn.q_proj.",
    r"^model\.transformer\.blocks\.(\d+)\.k_proj\.": r"model.layers.\1.self_attn.k_proj.",
    r"^model\.transformer\.blocks\.(\d+)\.v_proj\.": r"model.layers.\1.self_attn.v_proj.",
    r"^model\.transformer\.blocks\.(\d+)\.attn_out\.": r"model.layers.\1.self_attn.o_proj.",
    r"^model\.transformer\.blocks\.(\d+)\.ff_proj\.": r"model.layers.\1.mlp.gate_proj.",
    r"^model\.transformer\.blocks\.(\d+)\.up_proj\.": r"model.layers.\1.mlp.up_proj.",
    r"^model\.transformer\.blocks\.(\d+)\.ff_out\.": r"model.layers.\1.mlp.down_proj.",
}


def load_torch_model(hf_dir: str, cfg):
    """The exported HF folder in transformers: LLaDA-MoE as Qwen3MoeForCausalLM (same names; the
    per-expert tensors are fused by transformers' own Qwen3-MoE loader), LLaDA as LlamaForCausalLM."""
    import torch
    common = dict(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_layers,
                  num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                  rms_norm_eps=cfg.rms_norm_eps, max_position_embeddings=cfg.max_position_embeddings,
                  rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
                  tie_word_embeddings=cfg.tie_word_embeddings, attention_bias=False)
    if cfg.rotary != cfg.head_dim:
        raise SystemExit(f"partial rotary ({cfg.rotary} of {cfg.head_dim}) has no transformers peer here")
    if cfg.family == "llada_moe":
        from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
        if not cfg.qk_norm:
            raise SystemExit("LLaDA-MoE without qk-norm has no Qwen3-MoE equivalent")
        hf = Qwen3MoeConfig(intermediate_size=4 * cfg.hidden_size, moe_intermediate_size=cfg.intermediate_size,
                            num_experts=cfg.num_experts, num_experts_per_tok=cfg.num_experts_per_tok,
                            norm_topk_prob=cfg.norm_topk_prob, decoder_sparse_step=1, mlp_only_layers=[],
                            use_sliding_window=False, **common)
        cls, kw = Qwen3MoeForCausalLM, {}
    else:
        from transformers import LlamaConfig, LlamaForCausalLM
        hf = LlamaConfig(intermediate_size=cfg.intermediate_size, mlp_bias=False, **common)
        cls, kw = LlamaForCausalLM, {"key_mapping": LLADA_TO_LLAMA}
    model, info = cls.from_pretrained(hf_dir, config=hf, dtype=torch.float32, output_loading_info=True, **kw)
    bad = {k: v for k, v in info.items() if v and k in ("missing_keys", "unexpected_keys", "mismatched_keys")}
    if bad:
        raise RuntimeError(f"transformers did not load every exported tensor: {bad}")
    return model.eval()


class TorchPeer:
    """A host loop over a transformers model implementing our decoding semantics (batch 1, T = 0)."""

    def __init__(self, model, mask_id: int, eos_id: int):
        import torch
        self.torch = torch
        self.model = model
        self.mask_id, self.eos_id = mask_id, eos_id
        self.rope = sys.modules[type(model).__module__].apply_rotary_pos_emb

    # -- forwards
    def full_forward(self, x, lo: int, hi: int, want_kv: bool):
        """Whole canvas through the HF model, bidirectional -> (logits [lo, hi), per-layer (K, V) or None)."""
        torch = self.torch
        L = x.shape[1]
        out = self.model(input_ids=x, attention_mask=torch.zeros(1, 1, L, L), use_cache=want_kv,
                         logits_to_keep=torch.arange(lo, hi))
        if not want_kv:
            return out.logits[0], None
        cache = out["cache"] if "cache" in out else out["past_key_values"]  # renamed in transformers 5.x
        return out.logits[0], [(layer.keys, layer.values) for layer in cache.layers]

    def window_forward(self, x_win, start: int, kv):
        """The block's tokens through the HF layers' submodules; keys/values = the cached ones with
        [start, start + S) replaced by this window's fresh K/V (a copy: nothing is written back)."""
        torch, F = self.torch, self.torch.nn.functional
        m = self.model.model
        S = x_win.shape[1]
        h = m.embed_tokens(x_win)
        cos, sin = m.rotary_emb(h, torch.arange(start, start + S)[None])
        for layer, (k_cache, v_cache) in zip(m.layers, kv):
            a = layer.self_attn
            n = layer.input_layernorm(h)
            shape = (1, S, -1, a.head_dim)
            q, k, v = a.q_proj(n).view(shape), a.k_proj(n).view(shape), a.v_proj(n).view(shape)
            if hasattr(a, "q_norm"):  # LLaDA-MoE: per-head RMSNorm before RoPE
                q, k = a.q_norm(q), a.k_norm(k)
            q, k = self.rope(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
            keys = torch.cat([k_cache[:, :, :start], k, k_cache[:, :, start + S:]], dim=2)
            values = torch.cat([v_cache[:, :, :start], v.transpose(1, 2), v_cache[:, :, start + S:]], dim=2)
            o = F.scaled_dot_product_attention(q, keys, values, scale=a.scaling, enable_gqa=True)
            h = h + a.o_proj(o.transpose(1, 2).reshape(1, S, -1))
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return self.model.lm_head(m.norm(h))[0]

    # -- strategies (strategies.py semantics on one block)
    def confidence(self, logits, cand):
        picked = logits.gather(-1, cand[:, None])[:, 0]
        return (picked - self.torch.logsumexp(logits, -1)).exp()

    def fixed_transfer(self, logits, x_blk, quota: int):
        """Top-`quota` masked positions by confidence (ties: lower position)."""
        torch = self.torch
        cand = logits.argmax(-1)
        masked = x_blk == self.mask_id
        c = torch.where(masked, self.confidence(logits, cand), -torch.inf)
        transfer = torch.zeros_like(masked)
        transfer[torch.argsort(-c, stable=True)[:quota]] = True
        return cand, transfer & masked

    def threshold_transfer(self, logits, x_blk, tau):
        """Every eligible position with conf >= min(max conf - 1e-5, tau); if nothing is eligible (all
        argmaxes are the mask token), the most confident masked position with its best non-mask token."""
        torch = self.torch
        cand = logits.argmax(-1)
        masked = x_blk == self.mask_id
        eligible = masked & (cand != self.mask_id)
        if not eligible.any():
            alt = logits.clone()
            alt[:, self.mask_id] = -torch.inf
            cand = alt.argmax(-1)
            c = torch.where(masked, self.confidence(logits, cand), -torch.inf)
            transfer = torch.zeros_like(masked)
            transfer[c.argmax()] = True
            return cand, transfer & masked
        c = torch.where(eligible, self.confidence(logits, cand), -torch.inf)
        tau_eff = torch.clamp(torch.minimum(c.max() - 1e-5, tau), min=-1000.0)
        return cand, eligible & (c >= tau_eff)

    # -- the loop
    def decode_block(self, x, lo: int, hi: int, s: Setting) -> int:
        """Decode x[:, lo:hi] in place until the block is done -> forwards used."""
        torch = self.torch
        tau = torch.tensor(s.threshold, dtype=torch.float32)
        n_entry = int((x[0, lo:hi] == self.mask_id).sum())
        kv = None
        for step in range(s.steps_per_block if s.strategy == "fixed" else hi - lo):
            if s.cache == "none" or step == 0:  # dual: the block-entry full forward refreshes the cache
                logits, kv = self.full_forward(x, lo, hi, want_kv=s.cache == "dual")
            else:
                logits = self.window_forward(x[:, lo:hi], lo, kv)
            blk = x[0, lo:hi]
            if s.strategy == "fixed":
                quota = n_entry // s.steps_per_block + int(step < n_entry % s.steps_per_block)
                cand, transfer = self.fixed_transfer(logits, blk, quota)
            else:
                cand, transfer = self.threshold_transfer(logits, blk, tau)
            x[0, lo:hi] = torch.where(transfer, cand, blk)
            if s.strategy != "fixed" and not (x[0, lo:hi] == self.mask_id).any():
                break
        return step + 1

    def generate(self, prompt: list[int], s: Setting):
        """-> (generation region as a list, number of forwards)."""
        P, G, Bk = len(prompt), s.gen_length, s.block_length
        x = self.torch.tensor([list(prompt) + [self.mask_id] * G])
        nfe = 0
        for lo in range(P, P + G, Bk):
            nfe += self.decode_block(x, lo, lo + Bk, s)
            if (x[0, lo:lo + Bk] == self.eos_id).any():  # early stop: everything after the block is EOS
                x[0, lo + Bk:] = self.eos_id
                break
        return x[0, P:].tolist(), nfe


# ---------------------------------------------------------------------------------------------
# The dinfer-jax side


class JaxSide:
    def __init__(self, model):
        from dinfer_jax.engine import Generator
        self.gen = Generator(model)

    def generate(self, prompt: list[int], s: Setting):
        import numpy as np
        r = self.gen.generate([np.asarray(prompt, np.int32)], s.sampling_params())  # blocks until on host
        return r.raw_ids[0].tolist(), r.nfe[0]


# ---------------------------------------------------------------------------------------------
# Timing and checks


def run_round(side, prompts, s: Setting):
    """All prompts one at a time -> (seconds, outputs, nfes)."""
    outs, nfes = [], []
    t = time.perf_counter()
    for p in prompts:
        o, n = side.generate(p, s)
        outs.append(o)
        nfes.append(n)
    return time.perf_counter() - t, outs, nfes


def check_same(peer, ours, s: Setting):
    """Raise on the first prompt whose tokens or NFE differ."""
    (p_out, p_nfe), (j_out, j_nfe) = peer, ours
    for i, (a, b) in enumerate(zip(p_out, j_out)):
        if a != b:
            pos = next(k for k, (u, v) in enumerate(zip(a, b)) if u != v)
            raise AssertionError(f"[{s.strategy}/{s.cache}] prompt {i}: tokens differ first at generated position "
                                 f"{pos}: peer {a[pos]} vs dinfer-jax {b[pos]}\n  peer:       {a}\n  dinfer-jax: {b}")
    if p_nfe != j_nfe:
        raise AssertionError(f"[{s.strategy}/{s.cache}] identical tokens but NFE differs per prompt: "
                             f"peer {p_nfe} vs dinfer-jax {j_nfe}")


def count_tokens(outs, eos_id: int, mask_id: int) -> int:
    """Generated non-EOS (non-mask) tokens, as the engine counts them."""
    return sum(sum(1 for t in o if t not in (eos_id, mask_id)) for o in outs)


def compare(peer, ours, prompts, s: Setting, repeats: int, eos_id: int, mask_id: int) -> dict:
    """Untimed warm-up round of each side (compiles dinfer-jax), then `repeats` timed rounds
    alternating which side goes first; every round's outputs are checked."""
    sides = {"peer": peer, "jax": ours}
    results = {name: run_round(side, prompts, s) for name, side in sides.items()}
    check_same(results["peer"][1:], results["jax"][1:], s)
    times = {"peer": [], "jax": []}
    for r in range(repeats):
        for name in (("peer", "jax") if r % 2 == 0 else ("jax", "peer")):
            secs, outs, nfes = run_round(sides[name], prompts, s)
            times[name].append(secs)
            results[name] = (secs, outs, nfes)
        check_same(results["peer"][1:], results["jax"][1:], s)
    _, outs, nfes = results["jax"]
    tokens = count_tokens(outs, eos_id, mask_id)
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"setting": s.label(), "strategy": s.strategy, "cache": s.cache, "batch": 1, "prompts": len(prompts),
            "nfe": sum(nfes), "tokens": tokens, "peer_s": med["peer"], "jax_s": med["jax"],
            "peer_tok_s": tokens / med["peer"], "jax_tok_s": tokens / med["jax"],
            "ratio": med["peer"] / med["jax"], "times": times, "nfe_per_prompt": nfes}


def markdown_table(rows) -> str:
    head = ("| setting | strategy | cache | batch | NFE | tokens | peer s | jax s | peer tok/s | jax tok/s | ratio |\n"
            "|---|---|---|---|---|---|---|---|---|---|---|")
    lines = [f"| {r['setting']} | {r['strategy']} | {r['cache']} | {r['batch']} | {r['nfe']} | {r['tokens']} | "
             f"{r['peer_s']:.3f} | {r['jax_s']:.3f} | {r['peer_tok_s']:.1f} | {r['jax_tok_s']:.1f} | "
             f"{r['ratio']:.2f}x |" for r in rows]
    return "\n".join([head] + lines)


# ---------------------------------------------------------------------------------------------


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="demo", help="'demo' (built-in) or a LLaDA-MoE / LLaDA folder (HF or dinfer-jax)")
    ap.add_argument("--random-preset", help="random weights of this preset (e.g. llada-moe-7b-a1b, tiny) instead")
    ap.add_argument("--layers", type=int, default=0, help="with --random-preset: number of layers (0 = the preset's)")
    ap.add_argument("--head-scale", type=float, default=40.0, help="with --random-preset: LM head multiplier")
    ap.add_argument("--strategies", default="fixed,threshold", help="comma list of fixed (no cache), threshold (dual)")
    ap.add_argument("--gen-length", type=int, help="default: the model's generation defaults, else 64")
    ap.add_argument("--block-length", type=int, help="default: the model's generation defaults, else 32")
    ap.add_argument("--steps", type=int, help="fixed strategy: total steps (default gen_length)")
    ap.add_argument("--threshold", type=float, default=0.9)
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--prompt", action="append", help="prompt text (repeatable; needs the model's tokenizer)")
    ap.add_argument("--prompt-len", type=int, default=64, help="random prompts (non-demo models): tokens each")
    ap.add_argument("--seed", type=int, default=0, help="prompt sampling seed")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", help="write raw timings + versions here (JSON)")
    a = ap.parse_args(argv)
    bad = set(a.strategies.split(",")) - {"fixed", "threshold"}
    if bad:
        ap.error(f"unknown strategies {sorted(bad)}; choose from fixed, threshold")
    return a


def versions() -> dict:
    import jax
    import jaxlib
    import torch
    import transformers
    return {"jax": jax.__version__, "jaxlib": jaxlib.__version__,
            "torch": torch.__version__, "transformers": transformers.__version__, "python": platform.python_version()}


def main(argv=None):
    args = parse_args(argv)
    pin_threads(args.threads)
    import jax.numpy as jnp
    import torch
    torch.set_num_threads(args.threads)
    from converters import export
    from dinfer_jax import checkpoint as ckpt
    from dinfer_jax import load_model

    with tempfile.TemporaryDirectory(prefix="compare_torch_") as work:
        folder, weights = prepare_checkpoint(args, work)
        hf_dir = os.path.join(work, "hf")
        export(folder, hf_dir, progress=False)
        model = load_model(folder, dtype=jnp.float32)
        cfg = model.config
        tmodel = load_torch_model(hf_dir, cfg)
        defaults = ckpt.generation_defaults(folder) if not args.random_preset else {}
        prompts, prompt_note = make_prompts(args, folder, cfg)
    gen = args.gen_length or defaults.get("gen_length", 64)
    block = args.block_length or min(gen, defaults.get("block_length", 32))
    peer, ours = TorchPeer(tmodel, cfg.mask_token_id, cfg.eos_token_id), JaxSide(model)
    rows = []
    with torch.inference_mode():
        for strategy in args.strategies.split(","):
            s = Setting(strategy, gen, block, args.steps or gen, args.threshold)
            rows.append(compare(peer, ours, prompts, s, args.repeats, cfg.eos_token_id, cfg.mask_token_id))
    print(f"weights: {weights}; prompts: {prompt_note}; fp32, CPU, {args.threads} threads, "
          f"median of {args.repeats} alternating rounds; tokens identical and NFE equal on every round")
    print(markdown_table(rows))
    if args.out:
        record = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                  "command": " ".join([os.path.relpath(sys.argv[0], ROOT)] + sys.argv[1:]) if argv is None
                  else " ".join(["bench/compare_torch.py"] + list(argv)),
                  "versions": versions(), "threads": args.threads, "cpus": sorted(os.sched_getaffinity(0)),
                  "weights": weights, "prompts": prompt_note, "prompt_lengths": [len(p) for p in prompts],
                  "torch_attention": tmodel.config._attn_implementation,
                  "torch_experts": getattr(tmodel.config, "_experts_implementation", None),
                  "config": dataclasses.asdict(cfg), "rows": rows}
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
