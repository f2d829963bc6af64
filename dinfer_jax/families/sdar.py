"""SDAR (JetAstra/SDAR; JetLM/SDAR-{1.7B,4B,8B}-Chat, SDAR-30B-A3B-{Chat,Sci}; TraDo is built on it):
Qwen3 (dense, `SDARForCausalLM`, model_type "sdar") and Qwen3-MoE (`SDARMoeForCausalLM`) converted
to block diffusion. The network is Qwen3's exactly (pre-norm RMSNorm, per-head q/k RMSNorm before
full NeoX RoPE, GQA, no biases, SwiGLU; MoE: softmax router over all experts in fp32, top-k,
renormalised when norm_topk_prob), with Qwen3's tensor names; only the attention differs: block-causal
(bidirectional inside a block of `block_size` = 4 positions, causal across blocks), and logits are
NOT shifted (position i's logits predict token i).

Facts and their sources (all read in public code; nothing copied):
  [C1] JetAstra/SDAR @ c2041a8 `training/model/SDAR-{4B,8B}-Chat/`: config.json (architectures
       ["SDARForCausalLM"], model_type "sdar", block_size 4, mask_token_id 151669, bos = eos = 151643,
       attention_bias false, head_dim 128, rope_theta 1e6, rms_norm_eps 1e-6, vocab 151936,
       tie_word_embeddings false, max_position_embeddings 32768; 4B: D 2560, 36 layers, 32/8 heads,
       F 9728; 8B: D 4096, 36 layers, 32/8 heads, F 12288), generation_config.json (eos [151645
       <|im_end|>, 151643 <|endoftext|>], pad 151643, temperature 0.6, top_k 20, top_p 0.95),
       added_tokens.json (<MASK> 151669, <|im_start|> 151644, <|im_end|> 151645), chat_template.jinja
       (Qwen3 ChatML with <think>), model.safetensors.index.json (Qwen3 names; total_size = 2 bytes x
       our parameter count, tests/test_sdar.py), modeling_sdar.py (Qwen3 attention with q_norm/k_norm;
       inference attention: SDPA with the caller's bool mask, or non-causal flash attention when the
       mask is all true; training loss on the hidden states of the masked positions themselves: no
       logit shift);
  [C2] the same repo's generate.py and evaluation/opencompass/opencompass/models/huggingface_bd3.py
       (the decoding rule, see DECODING below);
  [C3] PKU-SEC-Lab/TEAM-MoE-dLLM `modeling_sdar_moe.py` (a modified copy of the SDAR-30B-A3B remote
       code): Qwen3-MoE block (`mlp.gate`, `mlp.experts.{j}.{gate,up,down}_proj`, softmax in fp32,
       top-k, divide by the top-k sum when config.norm_topk_prob; `mlp_only_layers`,
       `decoder_sparse_step` as in Qwen3-MoE);
  [C4] JetEngine `jetengine/models/sdar_moe.py` (index copy): same MoE block, always renormalised;
       SGLang `DLLM_PARAMS`: SDARForCausalLM and SDARMoeForCausalLM -> block_size 4, mask_id 151669.

NOT pinned down (assumed, marked in PRESETS): the SDAR-30B-A3B and SDAR-1.7B config.json files were
not seen; their presets take the Qwen3-30B-A3B / Qwen3-1.7B shapes they were converted from (the
README says "Qwen3 series" / "Qwen3-30B-MoE"), max_position_embeddings 32768 as in [C1], and 1.7B's
tied embeddings from Qwen3-1.7B. The MoE model_type string (we write "sdar_moe"; JetEngine only tests
that it contains "sdar" and "moe") and the SDARMoeConfig default of norm_topk_prob (we default to
transformers' Qwen3MoeConfig default, false, when the field is absent) are unverified.

DECODING [C2]: SDAR's generate() is LLaDA2.0's block rule on our block loop (cache="block"):
  canvas = prompt + masks up to whole blocks of B = block_length (absolute blocks, prefill of the
  floor(P / B) full prompt blocks, the prompt tail shares the first decoded block); per block,
  `denoising_steps` steps with the transfer schedule n_s = B // steps (+1 on the first B % steps
  steps) = our `steps` (SamplingParams.steps, per block); each step: sample every position (our
  sampler: temperature 0 -> argmax, p its softmax probability; T > 0 -> logits / T, top-k, top-p,
  one draw, p under the filtered softmax, as generate.py), then
    low_confidence_dynamic(confidence_threshold = t): commit the masked positions with p > t if there
      are at least n_s of them, else the top-n_s by p  == our threshold=t with steps;
    low_confidence_static: the top-n_s by p  == our threshold >= 1.0 (p > 1 never holds) with steps;
  a block ends when it has no mask; after a block, generation stops if any stop id is in the
  generated part (generation_config's list: EOS and <|im_end|>; our block loop stops on EOS and on
  ModelConfig.eot_token_id = <|im_end|>, and outputs are cut before the first of them). Exact mapping: SamplingParams(cache="block", block_length=B, steps=denoising_steps,
  threshold=confidence_threshold (or 1.0 for static), temperature, top_k, top_p).
Known differences (documented, not reproduced):
  - when fewer masks remain than n_s (only possible with n_s > 1, i.e. denoising_steps < block_length,
    after a step that committed more than scheduled), generate.py's top-k picks non-mask positions
    too and overwrites them with the fresh sample; huggingface_bd3.py keeps them (x0 = where(mask,
    x0, x)), which is what we do (top-min(n_s, #masked));
  - huggingface_bd3.py takes the confidence p from the temperature-scaled softmax BEFORE top-k/top-p
    (its eval config: temperature 1, top_k 1 = greedy with the plain softmax probability), generate.py
    from the filtered softmax: both are built, SamplingParams.confidence_before_filter=True / False
    (identical at temperature 0; tests/test_sdar.py checks that temperature 1, top_k 1 with the knob
    decodes exactly as temperature 0);
  - denoising_steps > block_length: generate.py's schedule gives 0 tokens at later steps; ours
    commits at least num_to_transfer (1) per step (the evaluation code asserts B % steps == 0);
  - the returned tokens: SDAR returns the whole canvas (prompt, stop ids and anything after them in
    the last block); we return the generated part cut before the first stop id;
  - forwards: SDAR stores a finished block's K/V with one extra forward on the clean block; our loop
    computes them inside the next block's first forward ([previous | current] window), so a block
    costs one forward less and NFE counts the decoder steps only.

REMASKING `sequential` / `entropy_bounded` [C2: generate.py @ c2041a8, block_diffusion_generate();
entropy_bounded was added by commit 1c06c39 (2025-09-09); huggingface_bd3.py has neither, only
low_confidence and random]. Read in the source (facts; the token written is always the sampled x0):
  sequential: with f = the lowest masked index of the block, positions [f, f + n_s) of the block
    (a slice: cut at the block end, taken whether masked or not; "No mask tokens" error otherwise,
    unreachable since a clean block leaves the step loop first); n_s as above (denoising_steps);
  entropy_bounded (eps = 1e-12; eb_threshold: CLI --eb_threshold, default 0.35, "entropy threshold
    for entropy bounded sampling", required for this strategy; the function's default is None):
    e = -(clamp(x0_p, eps) * log clamp(x0_p, eps)).sum(dim=-1), where x0_p (batch, block) is each
    position's SAMPLED token probability from the sampler (temperature, top-k, top-p filtered
    softmax); masked positions take e, the others +inf; ascending torch.sort (not stable); cumsum;
    k = searchsorted(cumsum, eb_threshold, right=False), i.e. the number of running sums STRICTLY
    below eb_threshold; k = max(1, min(k, #masked)); commit the first k of the sorted order.
    num_transfer_tokens is not used; the block's step loop still has denoising_steps + 1 iterations
    (each: a denoising forward while the block holds a mask, else the K/V-storing forward and exit).
  As published, entropy_bounded does not run and does not compute a per-position entropy: (1) its
  branch never creates `transfer_index` (the other branches do, with zeros_like), so its first step
  raises UnboundLocalError; (2) x0_p has no vocabulary axis, so `.sum(dim=-1)` adds -p log p over
  the BLOCK positions (masked or not) into one number per row, which only broadcasts back for batch
  1 and gives every masked position the same value (the order among them is then torch.sort's
  unspecified tie order).
Built (SamplingParams.strategy on cache="block", decoding/block_loop.py; no SDAR-specific code):
  strategy="sequential": the leftmost min(n, #masked) masked positions of the block. Equal to SDAR's
    slice while the mask id itself is never committed: the block's masks then stay a suffix (only
    the prompt tail precedes them), so [f, f + n_s) holds masks only, cut at the block end. (If a
    sampled token IS the mask id, that position stays masked and leaves a hole: SDAR's slice then
    re-samples the clean positions after it, ours takes the next masks.)
  strategy="entropy_bounded", eb_threshold=b (> 0): the masked positions in order of increasing
    entropy (ties: lower position first), k = #{running sums of the sorted entropies < b} (strict,
    as searchsorted(right=False)), k = min(max(k, n), #masked); the running sum is in fp32.
    ASSUMED (the source cannot decide it, above): a position's entropy is the Shannon entropy
    -sum_v q_v log q_v (nats) of its own sampling distribution q over the vocabulary, the one its
    confidence is read from (temperature 0: the softmax of the logits; T > 0: the tempered, top-k /
    top-p filtered softmax, filtered-out tokens contributing 0; with confidence_before_filter, the
    tempered softmax before the filters), which is what `.sum(dim=-1)` computes on a (batch, block,
    vocab) probability tensor and what the name says. Not reproduced: the per-row sum over the
    block and the crash.
  n = the loop's per-step count: SDAR's at-least-one is n = 1 (num_to_transfer 1 with steps=None,
    or steps = block_length, e.g. the family default 4 = B); `steps` < B raises the floor to the
    schedule's n_s (ours; SDAR's entropy_bounded has no floor but 1). A block runs until it has no
    mask (each step commits >= 1, so at most B steps), not SDAR's denoising_steps + 1 cap, which
    could leave masks in a block if the strategy ran.
  Exact mappings: sequential = SamplingParams(cache="block", block_length=B, strategy="sequential",
  steps=denoising_steps, temperature, top_k, top_p); entropy_bounded = SamplingParams(cache="block",
  block_length=B, strategy="entropy_bounded", eb_threshold=eb_threshold, steps=None or B). `threshold`
  is unused by both; they do not combine with editing, indel or sub_block_length (refused), nor with
  the full-canvas caches. Checked: tests/test_sdar_remasking.py (host-loop reference at temperature 0,
  batch of prompts of different lengths, tokens and forwards).
"""
from __future__ import annotations

from converters.mappings import Entry, decoder_entries
from dinfer_jax.config import ConfigError, ModelConfig, need, rope_theta
from dinfer_jax.families import CHATML_TEMPLATE, Family

# [C1]: <MASK> 151669 (config.json mask_token_id), <|endoftext|> 151643 = bos = eos = pad,
# <|im_end|> 151645 ends a chat turn (generation_config.json's first eos).
DEFAULT_IDS = dict(mask_token_id=151669, eos_token_id=151643, pad_token_id=151643, eot_token_id=151645)
BLOCK_SIZE = 4  # config.json block_size [C1]; SGLang DLLM_PARAMS [C4]
ARCH_DENSE, ARCH_MOE = "SDARForCausalLM", "SDARMoeForCausalLM"


def read_config(hf, ids_for_vocab, where) -> ModelConfig:
    arch = hf["architectures"][0]
    if hf.get("attention_bias"):
        raise ConfigError(f"{where}: attention_bias=true: biases are not supported (SDAR/Qwen3 has none)")
    if hf.get("use_sliding_window"):
        raise ConfigError(f"{where}: use_sliding_window=true is not supported")
    if hf.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"{where}: hidden_act={hf['hidden_act']!r}: only silu (SwiGLU) is supported")
    rs = hf.get("rope_scaling") or {}
    if rs.get("rope_type", rs.get("type", "default")) not in ("default", None):
        raise ConfigError(f"{where}: rope_scaling={hf['rope_scaling']} is not supported")
    D = int(need(hf, "hidden_size", where=where))
    N = int(need(hf, "num_attention_heads", where=where))
    H = int(hf.get("head_dim") or D // N)
    V = int(need(hf, "vocab_size", where=where))
    block = hf.get("block_size")
    block = BLOCK_SIZE if block is None else block  # absent in one 8B config copy [C1]: the default 4
    if not isinstance(block, int) or isinstance(block, bool) or block <= 0:
        raise ConfigError(f"{where}: block_size={block!r} must be a positive integer (SDAR's attention block)")
    moe = {}
    if arch == ARCH_MOE:
        if hf.get("mlp_only_layers"):
            raise ConfigError(f"{where}: mlp_only_layers={hf['mlp_only_layers']}: only all-MoE layer stacks are "
                              f"supported")
        if int(hf.get("decoder_sparse_step", 1)) != 1:
            raise ConfigError(f"{where}: decoder_sparse_step={hf['decoder_sparse_step']}: only all-MoE layer "
                              f"stacks (1) are supported")
        moe = dict(num_experts=int(need(hf, "num_experts", where=where)),
                   num_experts_per_tok=int(need(hf, "num_experts_per_tok", where=where)),
                   norm_topk_prob=bool(hf.get("norm_topk_prob", False)), router="softmax")
        F = int(need(hf, "moe_intermediate_size", where=where))
    else:
        F = int(need(hf, "intermediate_size", where=where))
    return ModelConfig(
        family="sdar", vocab_size=V, hidden_size=D, num_layers=int(need(hf, "num_hidden_layers", where=where)),
        num_heads=N, num_kv_heads=int(hf.get("num_key_value_heads") or N), head_dim=H, intermediate_size=F,
        rope_theta=rope_theta(hf, 1000000.0), rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)), qk_norm=True,
        attention_mask="block_causal", block_size=block, tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        max_position_embeddings=int(hf.get("max_position_embeddings", 32768)), **moe, **ids_for_vocab(V))


def write_config(cfg: ModelConfig) -> dict:
    out = dict(
        architectures=[ARCH_MOE if cfg.is_moe else ARCH_DENSE], model_type="sdar_moe" if cfg.is_moe else "sdar",
        hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, hidden_act="silu",
        rms_norm_eps=cfg.rms_norm_eps, rope_theta=cfg.rope_theta, rope_scaling=None, attention_bias=False,
        attention_dropout=0.0, use_sliding_window=False, sliding_window=None, vocab_size=cfg.vocab_size,
        tie_word_embeddings=cfg.tie_word_embeddings, max_position_embeddings=cfg.max_position_embeddings,
        block_size=cfg.block_size, mask_token_id=cfg.mask_token_id, bos_token_id=cfg.eos_token_id,
        eos_token_id=cfg.eos_token_id, pad_token_id=cfg.pad_token_id, use_cache=False)
    if cfg.is_moe:
        out.update(moe_intermediate_size=cfg.intermediate_size, num_experts=cfg.num_experts,
                   num_experts_per_tok=cfg.num_experts_per_tok, norm_topk_prob=cfg.norm_topk_prob,
                   decoder_sparse_step=1, mlp_only_layers=[])
    else:
        out["intermediate_size"] = cfg.intermediate_size
    if cfg.eot_token_id is not None:
        out["eot_token_id"] = cfg.eot_token_id
    return out


def weights(cfg: ModelConfig) -> list[Entry]:
    """Qwen3 / Qwen3-MoE tensor names [C1, C3]."""
    return decoder_entries(cfg)


# Qwen3 ChatML [C1 chat_template.jinja, its plain-message path; tools and <think> handling are in the
# model folder's own template, which always wins].
CHAT_TEMPLATE = CHATML_TEMPLATE

_QWEN = dict(family="sdar", vocab_size=151936, head_dim=128, rope_theta=1000000.0, rms_norm_eps=1e-6, qk_norm=True,
             attention_mask="block_causal", block_size=BLOCK_SIZE, max_position_embeddings=32768, **DEFAULT_IDS)
_TINY = dict(family="sdar", vocab_size=128, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
             rope_theta=1000000.0, rms_norm_eps=1e-6, qk_norm=True, attention_mask="block_causal",
             block_size=BLOCK_SIZE, max_position_embeddings=512, mask_token_id=127, eos_token_id=126,
             pad_token_id=126, eot_token_id=125)
PRESETS = {
    # [C1] config.json (verified, also against the safetensors index's total_size)
    "sdar-4b": ModelConfig(hidden_size=2560, num_layers=36, num_heads=32, num_kv_heads=8, intermediate_size=9728,
                           **_QWEN),
    "sdar-8b": ModelConfig(hidden_size=4096, num_layers=36, num_heads=32, num_kv_heads=8, intermediate_size=12288,
                           **_QWEN),
    # ASSUMED: Qwen3-1.7B's shapes (config.json not seen), tied embeddings as Qwen3-1.7B
    "sdar-1.7b": ModelConfig(hidden_size=2048, num_layers=28, num_heads=16, num_kv_heads=8, intermediate_size=6144,
                             tie_word_embeddings=True, **_QWEN),
    # ASSUMED: Qwen3-30B-A3B's shapes (config.json not seen): 48 layers, 128 experts of width 768, top-8
    "sdar-30b-a3b": ModelConfig(hidden_size=2048, num_layers=48, num_heads=32, num_kv_heads=4, intermediate_size=768,
                                num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, router="softmax",
                                **_QWEN),
    # Tiny SDAR-shaped models for tests: dense with tied embeddings (like 1.7B), and MoE (8 experts, top-2).
    "tiny-sdar": ModelConfig(intermediate_size=128, tie_word_embeddings=True, **_TINY),
    "tiny-sdar-moe": ModelConfig(intermediate_size=32, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
                                 router="softmax", **_TINY),
}

FAMILY = Family(
    name="sdar", architectures=(ARCH_DENSE, ARCH_MOE), read_config=read_config, write_config=write_config,
    weights=weights, default_ids=DEFAULT_IDS, chat_template=CHAT_TEMPLATE, bos_token="", presets=PRESETS,
    # generate.py's CLI defaults [C2]: block 4, denoising_steps 4, low_confidence_dynamic at 0.85
    # (module doc: DECODING); greedy (temperature 0) here, where generate.py samples at temperature 1.
    decoding=dict(block_length=BLOCK_SIZE, strategy="threshold", threshold=0.85, steps=BLOCK_SIZE, cache="block"),
)
