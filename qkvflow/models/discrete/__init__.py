"""Discrete parallel-block transformers: the Euler discretisation of a DiffEqFormer as layers."""

from .config import PARALLEL_CONFIGS, ParallelConfig, ParallelGpt2Config, ParallelLlamaConfig
from .model import ParallelLMHeadModel

__all__ = ["PARALLEL_CONFIGS", "ParallelConfig", "ParallelGpt2Config", "ParallelLlamaConfig", "ParallelLMHeadModel"]
