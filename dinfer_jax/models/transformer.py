"""The decoder stack shared by the registered families: full bidirectional or block-causal
attention, dense or MoE FFN (a MoE model's leading `first_k_dense` dense layers form a second stack,
`dense_layers`, run first). Params carry a leading layer axis (nn.scan at init); outside init the
stack runs through stacked.scan_layers. Param tree and shapes: docs/internals/model_code.md.
"""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from dinfer_jax.cache import as_starts, window_slice
from dinfer_jax.config import ModelConfig
from dinfer_jax.kernels import KernelConfig
from dinfer_jax.models import quant, stacked
from dinfer_jax.models.layers import _init as _default_init
from dinfer_jax.models.forward_inputs import ForwardInputs
from dinfer_jax.models.layers import MLP, Attention, RMSNorm, param, whole_kv_heads
from dinfer_jax.models.moe import MoE
from dinfer_jax.sharding import constrain


ACT_AXES = ("batch", "length", "embed")


def kv_axes(cfg: ModelConfig, mesh) -> tuple:
    """Logical axes of a layer's cached (B, L, K*H) K or V (the merged dim over the model axis only when
    it divides K)."""
    return ("batch", "length", "kv_heads" if whole_kv_heads(mesh, cfg.num_kv_heads) else None)


class DecoderLayer(nn.Module):
    """Pre-norm block: h = x + attn(norm(x)); y = h + mlp(norm(h)); mlp: MoE in a MoE model's main
    stack, else dense SwiGLU (`dense_ffn`: width cfg.dense_intermediate_size)."""
    cfg: ModelConfig
    dtype: jnp.dtype = jnp.float32
    kernels: KernelConfig = KernelConfig()  # .mesh: activations pinned by logical axes, MoE expert-parallel
    block_size: int = 0  # > 0: block-causal attention
    dense_ffn: bool = False

    @nn.compact
    def __call__(self, x_BSD, inputs: ForwardInputs, kv):
        c, mesh = self.cfg, self.kernels.mesh
        a, new_kv = Attention(c, self.dtype, self.kernels, name="attn")(
            RMSNorm(c.rms_norm_eps, "embed", self.dtype, name="attn_norm")(x_BSD), inputs, kv, self.block_size)
        h = constrain(x_BSD + a, ACT_AXES, mesh)
        m = RMSNorm(c.rms_norm_eps, "embed", self.dtype, name="mlp_norm")(h)
        if self.dense_ffn:
            y = MLP(c, self.dtype, c.dense_intermediate_size, name="mlp")(m)
        elif c.is_moe:
            y = MoE(c, self.dtype, self.kernels, name="mlp")(m)
        else:
            y = MLP(c, self.dtype, name="mlp")(m)
        new_kv = tuple(constrain(t, kv_axes(c, mesh), mesh) for t in new_kv)
        return constrain(h + y, ACT_AXES, mesh), new_kv


class Transformer(nn.Module):
    """__call__(tokens_BS | embeds_BSD, positions_BS, key_mask_BL=None, kv=None, window_start=None,
    kv_write_BS=None, logits_window=None, key_positions_BL=None, kv_in_place=False, kv_rows=None)
    -> (logits fp32, (k_LBLF, v_LBLF)),
    leading L = all layers (dense_layers first), F = K*H (the cache's layout, dinfer_jax/cache.py).

    Without `kv`, the S inputs are the whole sequence. With `kv` (full-length caches stacked over
    layers) they are per-row windows at `window_start` (scalar or (B,)) whose K/V are written into a
    returned copy (where kv_write_BS); kv_in_place=True writes back into kv's buffer; kv_rows (R,):
    the inputs are those distinct rows of kv's batch. key_mask_BL: True = attend.
    logits_window=(starts_B, size) -> (B, size, V) logits, else (B, S, V). Block-causal models mask
    over positions_BS / key_positions_BL (docs/internals/model_code.md).
    """
    cfg: ModelConfig
    dtype: jnp.dtype = jnp.float32
    # attention / expert paths, compile target, mesh (params placed with models.placement.param_shardings)
    kernels: KernelConfig = KernelConfig()
    attention_block: int = 0  # block-causal models: attention block size (0: cfg.block_size)

    @property
    def block_size(self) -> int:
        """The attention block (0 = full bidirectional attention)."""
        if self.cfg.attention_mask != "block_causal":
            return 0
        return self.attention_block or self.cfg.block_size

    def _stack(self, length: int, dense_ffn: bool):
        return nn.scan(  # over layers: (x carried; the inputs broadcast; each layer's kv)
            DecoderLayer, variable_axes={"params": 0}, split_rngs={"params": True},
            in_axes=(nn.broadcast, 0), length=length, metadata_params={nn.PARTITION_NAME: "layers"},
        )(self.cfg, self.dtype, self.kernels, self.block_size, dense_ffn)

    def setup(self):
        c = self.cfg
        self.embed = nn.Embed(c.vocab_size, c.hidden_size, param_dtype=self.dtype, dtype=self.dtype,
                              embedding_init=nn.with_logical_partitioning(
                                  nn.initializers.normal(0.02), ("vocab", "embed")))
        if c.first_k_dense:
            self.dense_layers = self._stack(c.first_k_dense, True)
        self.layers = self._stack(c.num_scanned_layers, False)
        self.final_norm = RMSNorm(c.rms_norm_eps, "embed", self.dtype)
        if not c.tie_word_embeddings:
            self.lm_head = LMHead(c.hidden_size, c.vocab_size, self.dtype)

    def _run_stack(self, name: str, dense_ffn: bool, x, inputs: ForwardInputs, kv, update=None):
        """The layer stack `name` over x (nn.scan at init; else stacked.scan_layers; update: scan_layers'
        in-place update of kv)."""
        if self.is_initializing():
            return getattr(self, name)(x, inputs, kv)
        layer = DecoderLayer(self.cfg, self.dtype, self.kernels, self.block_size, dense_ffn, parent=None)

        def fn(p_i, x, kv_i):
            return layer.apply({"params": p_i}, x, inputs, kv_i)
        return stacked.scan_layers(fn, self.variables["params"][name], x, kv, platform=self.kernels.platform,
                                   mesh=self.kernels.mesh, update=update)

    def embed_tokens(self, tokens_BS):
        """tokens_BS -> embeds_BSD (also used to build soft embeddings for iteration smoothing)."""
        return self.embed(tokens_BS)

    def __call__(self, tokens_BS=None, embeds_BSD=None, positions_BS=None, key_mask_BL=None,
                 kv=None, window_start=None, kv_write_BS=None, logits_window=None, key_positions_BL=None,
                 kv_in_place=False, kv_rows=None):
        if (tokens_BS is None) == (embeds_BSD is None):
            raise ValueError("Transformer: pass exactly one of tokens_BS or embeds_BSD")
        if (kv_in_place or kv_rows is not None) and (kv is None or self.is_initializing()):
            raise ValueError("Transformer: kv_in_place / kv_rows update a given kv cache")
        if kv_rows is not None and not kv_in_place:
            raise ValueError("Transformer: kv_rows gathers rows of a cache updated in place (kv_in_place=True)")
        x = self.embed(tokens_BS) if embeds_BSD is None else embeds_BSD.astype(self.dtype)
        x = constrain(x, ACT_AXES, self.kernels.mesh)
        B, S, _ = x.shape
        if positions_BS is None:
            positions_BS = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S))
        if self.block_size and kv is not None and key_positions_BL is None:
            raise ValueError("a block-causal forward over a KV cache needs key_positions_BL (B, L)")
        inputs = ForwardInputs(positions_BS, key_mask_BL, window_start, kv_write_BS, key_positions_BL)
        k0 = self.cfg.first_k_dense
        if kv_in_place:  # both stacks update their own layers of the one cache (no slices, no concatenate)
            with jax.named_scope("layers"):
                if k0:
                    x, kv = self._run_stack("dense_layers", True, x, inputs, kv, update=(0, kv_rows))
                x, new_kv = self._run_stack("layers", False, x, inputs, kv, update=(k0, kv_rows))
            return self._logits(x, B, logits_window), new_kv
        kv_dense, kv = (None, kv) if kv is None or not k0 else (
            tuple(t[:k0] for t in kv), tuple(t[k0:] for t in kv))
        with jax.named_scope("layers"):
            if k0:
                x, dense_kv = self._run_stack("dense_layers", True, x, inputs, kv_dense)
            x, new_kv = self._run_stack("layers", False, x, inputs, kv)
            if k0:
                new_kv = tuple(jnp.concatenate([a, b]) for a, b in zip(dense_kv, new_kv))
        return self._logits(x, B, logits_window), new_kv

    def _logits(self, x, B, logits_window):
        """Final norm and unembedding of the rows' window (logits_window) or all positions -> fp32."""
        if logits_window is not None:
            x = window_slice(x, as_starts(logits_window[0], B), logits_window[1])
        x = self.final_norm(x)
        if self.cfg.tie_word_embeddings:
            logits = self.embed.attend(x)
        else:
            logits = self.lm_head(x)
        return constrain(logits.astype(jnp.float32), ("batch", "length", "vocab"), self.kernels.mesh)


def _init_as_v1_kernel(key, shape, dtype):
    """The (V, D) table's init: the transpose of v1's (D, V) kernel from the same key (same seeded model)."""
    return _default_init(key, tuple(shape)[::-1], dtype).T


class LMHead(nn.Module):
    """logits_BSV = x_BSD @ unembedding (V, D).T (the table is stored out-first, like HF's lm_head.weight)."""
    features_in: int
    vocab: int
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x_BSD):
        w = param(self, "unembedding", (self.vocab, self.features_in), ("vocab", "embed"), self.dtype,
                  _init_as_v1_kernel)
        return quant.einsum("bsd,vd->bsv", x_BSD, w)
