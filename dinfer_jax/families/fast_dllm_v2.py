"""Fast-dLLM v2 (NVlabs; Efficient-Large-Model/Fast_dLLM_v2_7B and _1.5B): Qwen2.5-Instruct fine-tuned
(~1B tokens) into a block-diffusion model. The network is Qwen2's exactly (pre-norm RMSNorm, GQA,
q/k/v projections WITH biases, o_proj without, full NeoX RoPE theta 1e6, SwiGLU, no q/k norm), with
Qwen2's tensor names; inference attention is block-causal (bidirectional inside a block of
`bd_size` = 32 positions, causal across blocks) and the logits are SHIFTED: the logits that decode
position i are the output row of position i - 1 (`logit_shift=1`), keeping the AR head's meaning.

Facts and their sources (read in public code; nothing copied):
  [F1] NVlabs/Fast-dLLM `v2/run_chatbot.py` @ b9cf368 (the stored snapshot of the repo @ 24cc59e has no
       v2/ directory; the index holds only that file, v2/index.html and v2/requirements.txt): loads the
       HF folder with trust_remote_code, renders the tokenizer's chat template with
       add_generation_prompt, calls model.generate(block_size=32, small_block_size=8, threshold=0.9,
       max_new_tokens=2048), decodes with skip_special_tokens;
  [F2] the HF remote code `modeling.py` of Fast_dLLM_v2_7B, read in a third-party copy
       (Satgoy152/DualDiffusion @ 1aeb3d4, FastDLLM_inferencing/Fast_dLLM_v2_7B/modeling.py; its
       README.md names base model Qwen/Qwen2.5-7B-Instruct, 28 layers, 28 / 4 heads, block 32):
       classes Fast_dLLM_QwenForCausalLM / Fast_dLLM_QwenModel / Fast_dLLM_QwenConfig; q/k/v Linear
       with bias, o_proj without; RMSNorm fp32 statistics; Qwen2 rotary over the whole head; attribute
       names = Qwen2's (model.embed_tokens, model.layers.{l}.self_attn.{q,k,v,o}_proj,
       mlp.{gate,up,down}_proj, input_layernorm, post_attention_layernorm, model.norm, lm_head);
       config field `bd_size` (the training block); inference mask: query block >= key block over
       absolute positions (block = the generate() block_size, 32); generate() defaults mask_id 151665,
       stop_token 151645 (<|im_end|>), threshold 1, small_block_size 8, block_size 32, top_p 0.95,
       temperature 0, use_block_cache False; training: masked tokens + their complementary mask,
       loss through the standard causal-LM (shifted-label) loss, hence the token shift.
  DECODING [F2 generate()], temperature 0:
    - prefill: the prompt's whole blocks go to an exact K/V cache; a prompt that ends on a block
      boundary gets its next token by the argmax of the last prompt row (an AR step);
    - per block (the prompt tail shares the first block): forwards cover the block only, reading the
      cache; logits are shifted by one inside the block (position j uses row j - 1);
    - sub-blocks of small_block_size 8, left to right; per step (one forward): the masked positions
      of the current sub-block whose argmax probability exceeds the threshold, PLUS always the most
      probable masked one (so >= 1 per step); until the sub-block has no mask;
    - a finished block: one forward over it stores its K/V in the block cache (exact) and the
      argmax of its last row becomes the first token of the next block (AR step);
    - stop: when <|im_end|> (151645) is in the generated part with no mask before it; output cut
      after it;
    - use_block_cache=True (not the default, not used by run_chatbot.py): the sub-block DualCache.
      A step runs a forward over the whole block (reading the exact cache of finished blocks)
      that stores the block's K/V in a "block cache" when no block cache exists yet or when the
      current sub-block's FIRST position is still masked; otherwise a forward over the sub-block
      only (RoPE positions of the sub-block), whose fresh K/V replace the sub-block's entries of
      the block cache, the rest of the block being read stale from it; its logits are shifted
      inside the sub-block (the sub-block's first position uses its own row, but it is never a
      candidate then: it is decoded). In the copy read, that block cache is never reset between
      blocks: the first sub-block of a later block (whose first position is the AR token, not a
      mask) reads the PREVIOUS block's block cache (other tokens, other positions); we could not
      tell whether the released code does the same.
  BUILT here (SamplingParams(sub_block_cache=True), decoding/block_loop.py `sub_block_refresh`): a
  step runs the whole-block forward, which refreshes the block cache, when the current sub-block's
  first position is masked (Fast-dLLM v2's rule) OR when none of the sub-block's generated positions
  is decoded yet (our choice, replacing the cross-block stale read above: the block cache is
  refreshed at every sub-block start, so the first sub-block of every block, and a sub-block whose
  first position is prompt text, start with a whole-block forward); the other steps run a forward
  over the sub-block only (plus the query-only position on its left that shifted logits read), over
  the KV cache where the current block's positions hold the block cache. The block cache lives in
  the loop's one KV cache (the current block's slots, which the next block's first forward
  overwrites with the block's final K/V), so it needs no state of its own. The sub-block forward's
  fresh K/V are not written back (the copy writes them in place; under the rule above nothing reads
  them before the next refresh). Exact when every sub-block is decoded in one step (each step then
  enters a sub-block); checked token for token and in forwards against a host reference written
  from these facts (tests/test_fast_dllm_v2_block_cache.py).
  Our mapping (decoding/block_loop.py, module doc): SamplingParams(cache="block", block_length=32,
  sub_block_length=8, threshold=0.9, num_to_transfer=1) with logit_shift=1. The block's AR head is
  our block's first step (committed alone, from the last row of the previous block); tokens equal
  Fast-dLLM v2's at temperature 0 (tests/test_fast_dllm_v2.py checks a host reference written from
  these facts). Differences: NFE counts the head step of the first block when the prompt ends on a
  block boundary (Fast-dLLM takes it from the prefill); at temperature > 0 the head is sampled like
  any position (Fast-dLLM takes its argmax); we stop at the end of the block holding the stop id
  (the tokens before it are the same: committed tokens never change); gen_length replaces
  max_new_tokens // block_size blocks.
  Chat template: Qwen2.5 ChatML (<|im_start|>role\\n...<|im_end|>\\n, generation prompt
  <|im_start|>assistant\\n) [F1 uses the folder's own template; Qwen2.5-Instruct's also adds a
  default system message when none is given, which the folder's template does and ours does not].

ASSUMED (not seen): the config.json itself: architectures ["Fast_dLLM_QwenForCausalLM"] (the class
name in [F2]), model_type "Fast_dLLM_Qwen" (we accept any), the mask id's presence as
`mask_token_id` (else the default 151665), bd_size 32 when absent; eos 151645 / pad 151643 /
vocab and shapes = Qwen2.5-{7B,1.5B}-Instruct's (7B: vocab 152064, untied; 1.5B: vocab 151936, tied
embeddings, D 1536, 28 layers, 12 / 2 heads, F 8960); max_position_embeddings 32768.
"""
from __future__ import annotations

from converters.mappings import Entry, decoder_entries
from dinfer_jax.config import ConfigError, ModelConfig
from dinfer_jax.families import CHATML_TEMPLATE, Family
from dinfer_jax.families.qwen2_config import qwen2_fields, read_qwen2

# [F2] generate(): mask_id 151665, stop_token 151645 (<|im_end|>); Qwen2.5 <|endoftext|> 151643 = pad.
DEFAULT_IDS = dict(mask_token_id=151665, eos_token_id=151645, pad_token_id=151643, eot_token_id=None)
BLOCK_SIZE, SUB_BLOCK = 32, 8  # [F1] block_size, small_block_size
ARCH = "Fast_dLLM_QwenForCausalLM"


def read_config(hf, ids_for_vocab, where) -> ModelConfig:
    block = hf.get("bd_size", BLOCK_SIZE)
    if not isinstance(block, int) or isinstance(block, bool) or block <= 0:
        raise ConfigError(f"{where}: bd_size={block!r} must be a positive integer (Fast-dLLM v2's block)")
    return read_qwen2(hf, ids_for_vocab, where, max_position_default=32768, family="fast_dllm_v2",
                      attention_mask="block_causal", block_size=block)


def write_config(cfg: ModelConfig) -> dict:
    out = dict(
        architectures=[ARCH], model_type="Fast_dLLM_Qwen",
        auto_map={"AutoConfig": "configuration.Fast_dLLM_QwenConfig",
                  "AutoModelForCausalLM": "modeling.Fast_dLLM_QwenForCausalLM"},
        **qwen2_fields(cfg, "fast_dllm_v2", "block_causal", ARCH), bd_size=cfg.block_size,
        bos_token_id=cfg.pad_token_id)
    if cfg.eot_token_id is not None:
        out["eot_token_id"] = cfg.eot_token_id
    return out


def weights(cfg: ModelConfig) -> list[Entry]:
    """Qwen2 names with q/k/v biases [F2]; no lm_head when tied (1.5B, assumed)."""
    return decoder_entries(cfg)


# Qwen2.5 ChatML (module doc). A model folder's own chat_template (tokenizer_config.json) always wins.
CHAT_TEMPLATE = CHATML_TEMPLATE

_QWEN = dict(family="fast_dllm_v2", head_dim=128, rope_theta=1000000.0, rms_norm_eps=1e-6, qkv_bias=True,
             logit_shift=1, attention_mask="block_causal", block_size=BLOCK_SIZE, max_position_embeddings=32768,
             **DEFAULT_IDS)
PRESETS = {
    # Qwen2.5-7B-Instruct's shapes; layers / heads confirmed by [F2]'s README (ASSUMED: the rest).
    "fast-dllm-v2-7b": ModelConfig(vocab_size=152064, hidden_size=3584, num_layers=28, num_heads=28,
                                   num_kv_heads=4, intermediate_size=18944, **_QWEN),
    # ASSUMED: Qwen2.5-1.5B-Instruct's shapes, tied embeddings.
    "fast-dllm-v2-1.5b": ModelConfig(vocab_size=151936, hidden_size=1536, num_layers=28, num_heads=12,
                                     num_kv_heads=2, intermediate_size=8960, tie_word_embeddings=True, **_QWEN),
    # Tiny Fast-dLLM-v2-shaped model for tests: GQA 4/2, biases, shifted logits, block 8.
    "tiny-fast-dllm-v2": ModelConfig(
        family="fast_dllm_v2", vocab_size=128, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
        head_dim=16, intermediate_size=128, rope_theta=1000000.0, rms_norm_eps=1e-6, qkv_bias=True, logit_shift=1,
        attention_mask="block_causal", block_size=8, max_position_embeddings=512, mask_token_id=127,
        eos_token_id=126, pad_token_id=125),
}

FAMILY = Family(
    name="fast_dllm_v2", architectures=(ARCH,), read_config=read_config, write_config=write_config,
    weights=weights, default_ids=DEFAULT_IDS, chat_template=CHAT_TEMPLATE, bos_token="", presets=PRESETS,
    # [F1] run_chatbot.py: block 32, small block 8, threshold 0.9 (greedy: generate()'s temperature 0).
    decoding=dict(block_length=BLOCK_SIZE, sub_block_length=SUB_BLOCK, strategy="threshold", threshold=0.9,
                  cache="block"),
)
