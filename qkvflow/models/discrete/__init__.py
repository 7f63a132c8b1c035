"""Discrete parallel-block transformers: the Euler discretisation of a DiffEqFormer as layers."""

from .model import PARALLEL_CONFIGS, ParallelConfig, ParallelGpt2Config, ParallelLlamaConfig, ParallelLMHeadModel

__all__ = ["PARALLEL_CONFIGS", "ParallelConfig", "ParallelGpt2Config", "ParallelLlamaConfig", "ParallelLMHeadModel"]
