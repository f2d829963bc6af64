"""Kernels for dinfer-jax, each beside a pure-JAX reference it is tested against."""
