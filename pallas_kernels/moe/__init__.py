"""Grouped matmul for MoE experts."""
from pallas_kernels.moe.tiled import swiglu_experts_tiled, tile_rows_for

__all__ = ["swiglu_experts_tiled", "tile_rows_for"]
