"""The attention kernel lowers (interpret=False) with jax.export for TPU (Mosaic) and CUDA (Triton)
at every supported shape: interpret mode does not enforce the TPU (8, 128) block tiling rules nor
Triton's power-of-2 rule, lowering does.

Matrix (bf16): (N, K, H) in {16/16/128 LLaDA-MoE, 32/32/128 LLaDA-8B, 16/4/128 LLaDA2 GQA 4:1,
32/8/64 and 8/8/64 (H 64: two kv heads per 128-lane block), 16/2/64, 28/4/128 (Qwen2.5-7B: group 7,
padded to 8 on Triton)}; window S in {8, 32, 64} (a
block) and 72 / 200 (vicinity / odd); cache L in {1024, 1088 (not a tile multiple), 4096, 32768};
masks: key padding, key padding + block-causal (block 32); batch 1 and 16 (L 32k with batch 1).
The batch-1 windows give the Triton body a small grid, so they lower its kv split (B=1, S=64,
L=4096 is the shape it was added for; L=1088: 17 tiles in unequal chunks).
Each lowering is ~0.1 s.
"""
import contextlib

import jax
import jax.numpy as jnp
import pytest
from jax import export

from dinfer_jax.aot import MOSAIC_TPU, TRITON, TRITON_DISABLED_CHECK, gpu_target
from pallas_kernels.attention import BlockSizes, flash_attention

pytestmark = pytest.mark.smoke

SDS = jax.ShapeDtypeStruct
HEADS = [(16, 16, 128), (32, 32, 128), (16, 4, 128), (32, 8, 64), (8, 8, 64), (16, 2, 64), (28, 4, 128)]
WINDOWS = [(1, 8, 1024), (16, 32, 4096), (1, 64, 1088), (16, 72, 1024), (1, 200, 32768), (1, 64, 32768),
           (1, 64, 4096)]


def _export(platform, B, S, L, N, K, H, block_size, block_sizes=BlockSizes()):
    backend = "tpu" if platform == "tpu" else "gpu"

    def f(q, k, v, mask, q_pos, k_pos):
        return flash_attention(q, k, v, mask, q_pos_BS=q_pos, k_pos_BL=k_pos, block_size=block_size,
                               block_sizes=block_sizes, backend=backend)
    args = (SDS((B, S, N, H), jnp.bfloat16), SDS((B, L, K, H), jnp.bfloat16), SDS((B, L, K, H), jnp.bfloat16),
            SDS((B, L), jnp.bool_), SDS((B, S), jnp.int32), SDS((B, L), jnp.int32))
    checks = [export.DisabledSafetyCheck.custom_call(TRITON_DISABLED_CHECK)] if platform == "cuda" else []
    with gpu_target() if platform == "cuda" else contextlib.nullcontext():
        return export.export(jax.jit(f), platforms=[platform], disabled_checks=checks)(*args).mlir_module()


@pytest.mark.parametrize("platform", ["tpu", "cuda"])
@pytest.mark.parametrize("block_size", [0, 32])
@pytest.mark.parametrize("N,K,H", HEADS)
def test_attention_lowers(N, K, H, block_size, platform):
    for B, S, L in WINDOWS:
        text = _export(platform, B, S, L, N, K, H, block_size)
        target = MOSAIC_TPU if platform == "tpu" else TRITON
        assert text.count(target) == 1, (B, S, L)


@pytest.mark.parametrize("block_size", [0, 32])
def test_cuda_lowers_the_kv_split_only_for_a_small_grid(block_size):
    """LLaDA-MoE's window (S=64, L=4096, 16/16 heads, H=128): at B=1 the Triton call writes the split's
    fp32 partials (B, K, nq, n_split, R, H) = (1, 16, 1, 8, 64, 128) and XLA merges them; at B=8 it
    writes the bf16 output (8, 16, 1, 64, 128) directly (no split); kv_splits=1 turns the split off."""
    one = _export("cuda", 1, 64, 4096, 16, 16, 128, block_size)
    assert one.count(TRITON) == 1 and "tensor<1x16x1x8x64x128xf32>" in one
    eight = _export("cuda", 8, 64, 4096, 16, 16, 128, block_size)
    assert eight.count(TRITON) == 1 and "tensor<8x16x1x64x128xbf16>" in eight and "x128xf32>" not in eight
    off = _export("cuda", 1, 64, 4096, 16, 16, 128, block_size, BlockSizes(kv_splits=1))
    assert "tensor<1x16x1x64x128xbf16>" in off and "x128xf32>" not in off


def test_tpu_rejects_a_block_that_breaks_the_tiling_rule():
    """Positive control for the lowering check: the pre-fix layout, a (squeezed, S, squeezed, H) block
    over (B, S, N, H), fails the Mosaic lowering with the tiling error (interpret mode accepts it)."""
    from jax.experimental import pallas as pl

    def copy(x_ref, o_ref):
        o_ref[...] = x_ref[...]
    spec = pl.BlockSpec((None, 64, None, 128), lambda b, n: (b, 0, n, 0))
    f = jax.jit(lambda x: pl.pallas_call(copy, grid=(1, 16), in_specs=[spec], out_specs=spec,
                                         out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype))(x))
    with pytest.raises(Exception, match="divisible by 8 and 128"):
        export.export(f, platforms=["tpu"])(SDS((1, 64, 16, 128), jnp.bfloat16))
