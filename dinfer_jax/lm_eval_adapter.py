"""An lm-evaluation-harness model backend: `--model dinfer_jax` (`python -m dinfer_jax.lm_eval_adapter
run ...` or the `lm_eval.models` entry point). model_args: pretrained, gen_length, block_length,
strategy, cache, threshold, low_threshold, factor, steps, batch_size, mc_num. generate_until decodes;
loglikelihood(_rolling) is LLaDA's Monte-Carlo masked-diffusion bound. Usage and the bound:
docs/internals/demo_model.md.
"""
from __future__ import annotations

import sys

import numpy as np

try:
    from lm_eval.api.model import LM
    from lm_eval.api.registry import register_model
except ImportError as e:  # pragma: no cover - exercised only without lm-eval installed
    raise ImportError("dinfer_jax.lm_eval_adapter needs lm-eval: pip install lm-eval") from e

_BUCKET = 32


def _bool(v):
    return v if isinstance(v, bool) else str(v).lower() in ("1", "true", "yes")


@register_model("dinfer_jax", "dinfer-jax")
class DinferJaxLM(LM):
    def __init__(self, pretrained: str | None = None, gen_length=None, block_length=None, strategy: str | None = None,
                 cache: str | None = None, threshold=None, low_threshold=None, factor=None, steps=None, batch_size=8,
                 mc_num=8, seed=0, **kwargs):
        super().__init__()
        from dinfer_jax import SamplingParams, load_model
        from dinfer_jax.checkpoint import DEMO_MODEL_DIR, check_model_folder
        from dinfer_jax.evaluate import sampling_params
        from dinfer_jax.hub import resolve_model
        from dinfer_jax.tokenizer import load_tokenizer
        # a folder, 'demo' / 'demo-block', or a Hub id ORG/NAME
        self.path = check_model_folder(resolve_model(pretrained) if pretrained else DEMO_MODEL_DIR)
        self.model = load_model(self.path)
        self.tok = load_tokenizer(self.path)
        lengths = {k: int(v) for k, v in (("gen_length", gen_length), ("block_length", block_length)) if v is not None}
        d = SamplingParams.for_model(self.model.config, self.path, **lengths)  # the model's defaults
        over = dict(threshold=None if threshold is None else float(threshold),
                    low_threshold=None if low_threshold is None else float(low_threshold),
                    factor=None if factor is None else float(factor), steps=None if steps is None else int(steps))
        self.sp = sampling_params(strategy, cache, d.gen_length, d.block_length, model=self.model, **over)
        self.batch_size_ = int(batch_size) if str(batch_size) != "auto" else 8
        self.mc_num = int(mc_num)
        self.rng = np.random.default_rng(int(seed))

    # -- generation
    def generate_until(self, requests, disable_tqdm: bool = False):
        from dinfer_jax.evaluate import run_prompts
        out = [None] * len(requests)
        groups: dict = {}
        for i, req in enumerate(requests):
            context, gen_kwargs = req.args
            until = gen_kwargs.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            groups.setdefault(tuple(until), []).append((i, context))
        cfg = self.model.config
        max_prompt = cfg.max_position_embeddings - self.sp.gen_length
        for until, items in groups.items():
            ids = [self.tok.encode(c)[-max_prompt:] or [cfg.eos_token_id] for _, c in items]
            run = run_prompts(self.model, self.tok, ids, self.sp, self.batch_size_, warmup=False)
            for (i, _), text in zip(items, run.outputs):
                for u in until:
                    if u and u in text:
                        text = text[:text.index(u)]
                out[i] = text
                self.cache_hook.add_partial("generate_until", requests[i].args, text)
        return out

    # -- likelihoods
    def _score(self, ctx_ids: list[int], cont_ids: list[int]) -> tuple[float, bool]:
        cfg = self.model.config
        M = cfg.mask_token_id
        n = len(cont_ids)
        if n == 0:
            return 0.0, True
        seq = np.asarray(ctx_ids + cont_ids, np.int32)
        L = len(seq)
        Lb = -(-L // _BUCKET) * _BUCKET
        if Lb > cfg.max_position_embeddings:
            raise ValueError(f"context + continuation ({L} tokens) exceed max_position_embeddings")
        c0 = len(ctx_ids)
        rows = [seq.copy()]
        rows[0][c0:] = M  # fully masked continuation: greedy check
        ls = []
        for _ in range(self.mc_num):
            k = int(self.rng.integers(1, n + 1))
            pos = self.rng.choice(n, size=k, replace=False)
            r = seq.copy()
            r[c0 + pos] = M
            rows.append(r)
            ls.append(k)
        batch = np.full((len(rows), Lb), cfg.eos_token_id, np.int32)
        batch[:, :L] = np.stack(rows)
        key_mask = np.zeros_like(batch, bool)
        key_mask[:, :L] = True
        logits = self.model.logits(batch, key_mask=key_mask)[:, :L]
        logp = logits - _logsumexp(logits)
        target = seq[c0:]
        greedy = bool(np.all(np.argmax(logits[0, c0:], -1) == target))
        total = 0.0
        for j, k in enumerate(ls, start=1):
            masked = batch[j, c0:L] == M
            tok_lp = logp[j, c0:][np.arange(n), target]
            total += float(np.sum(tok_lp[masked])) * n / k
        return total / max(1, len(ls)), greedy

    def loglikelihood(self, requests, disable_tqdm: bool = False):
        res = []
        for req in requests:
            context, continuation = req.args
            r = self._score(self.tok.encode(context), self.tok.encode(continuation))
            res.append(r)
            self.cache_hook.add_partial("loglikelihood", req.args, r)
        return res

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
        res = []
        for req in requests:
            (text,) = req.args[:1]
            ll, _ = self._score([], self.tok.encode(text))
            res.append(ll)
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, ll)
        return res


def _logsumexp(x):
    m = np.max(x, axis=-1, keepdims=True)
    return m + np.log(np.sum(np.exp(x - m), axis=-1, keepdims=True))


def main(argv=None):
    """`lm_eval` CLI with this backend registered (for lm-eval versions without plugin discovery)."""
    from lm_eval.__main__ import cli_evaluate
    saved = list(sys.argv)
    sys.argv = ["lm_eval"] + (list(argv) if argv is not None else saved[1:])  # lm_eval parses sys.argv
    try:
        cli_evaluate()
    finally:
        sys.argv = saved


if __name__ == "__main__":
    main()
