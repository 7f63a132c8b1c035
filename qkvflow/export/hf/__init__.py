"""PyTorch / `transformers` side of the export (torch code only; no JAX, no qkvflow imports below).

Exported folders carry `configuration_qkvflow.py` and `modeling_qkvflow.py` with an `auto_map`, so

    AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)

works without qkvflow installed. With qkvflow installed, `qkvflow.export.hf.register()` makes the
Auto classes know the model types, and `from_pretrained(DIR)` needs no remote code.
"""

from .configuration_qkvflow import QkvflowParallelGpt2Config, QkvflowParallelLlamaConfig

MODEL_TYPES = ("qkvflow_parallel_gpt2", "qkvflow_parallel_llama")
SOURCE_FILES = ("configuration_qkvflow.py", "modeling_qkvflow.py")


def register() -> None:
    """Register both flavours with AutoConfig and AutoModelForCausalLM (idempotent)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from .modeling_qkvflow import (  # lazy: torch is the optional `hf` extra; this package imports without it
        QkvflowParallelGpt2ForCausalLM,
        QkvflowParallelLlamaForCausalLM,
    )

    for config_cls, model_cls in (
        (QkvflowParallelGpt2Config, QkvflowParallelGpt2ForCausalLM),
        (QkvflowParallelLlamaConfig, QkvflowParallelLlamaForCausalLM),
    ):
        AutoConfig.register(config_cls.model_type, config_cls, exist_ok=True)
        AutoModelForCausalLM.register(config_cls, model_cls, exist_ok=True)
