"""Discrete parallel-block transformers: the Euler discretisation of a DiffEqFormer as layers."""

from .model import ParallelConfig, ParallelGpt2Config, ParallelLlamaConfig, ParallelLMHeadModel, SequentialGpt2Config

__all__ = ["ParallelConfig", "ParallelGpt2Config", "ParallelLlamaConfig", "ParallelLMHeadModel", "SequentialGpt2Config"]
