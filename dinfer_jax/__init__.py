"""dinfer-jax: a JAX/XLA inference framework for masked-diffusion language models."""
from dinfer_jax.config import ConfigError, ModelConfig
from dinfer_jax.families import preset
from dinfer_jax.engine import GenerationResult, SamplingParams, generate
from dinfer_jax.model import Model, load_model

__version__ = "0.1.0"
__all__ = ["ConfigError", "GenerationResult", "ModelConfig", "Model", "SamplingParams", "generate", "load_model",
           "preset"]
