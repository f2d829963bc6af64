"""Grouped matmul for MoE experts: `gmm` (megablox-style Pallas kernel, Mosaic on TPU) with its
pure-JAX reference, and SwiGLU expert helpers built on it and on the tile-padded scan."""
from pallas_kernels.moe.gmm import GmmBlockSizes, gmm, make_group_metadata, swiglu_experts_gmm
from pallas_kernels.moe.gmm_reference import gmm_reference
from pallas_kernels.moe.tiled import swiglu_experts_tiled, tile_rows_for

__all__ = ["GmmBlockSizes", "gmm", "gmm_reference", "make_group_metadata", "swiglu_experts_gmm",
           "swiglu_experts_tiled", "tile_rows_for"]
