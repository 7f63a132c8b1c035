"""Write a discrete `ParallelLMHeadModel` as a Hugging Face model folder.

    config.json               QkvflowParallel{Gpt2,Llama}Config + auto_map -> the two .py files below
    model.safetensors         torch state dict: haliax's to_torch_compatible_state_dict of the model
                              (its module names are the torch ones; see qkvflow.models.discrete.model)
    configuration_qkvflow.py  copied from qkvflow/hf, so trust_remote_code works without qkvflow
    modeling_qkvflow.py
    generation_config.json    special token ids; use_cache false (the torch model keeps no cache)
    tokenizer files           when a tokenizer is given
"""

import os
import shutil

import numpy as np
from haliax.state_dict import to_torch_compatible_state_dict
from levanter.layers.rotary import DefaultRotaryEmbeddingsConfig

from qkvflow.errors import UserError

HF_DIR = os.path.join(os.path.dirname(__file__), "hf")
WEIGHTS_FILE = "model.safetensors"


def hf_config(model, *, ode_steps=None, tokenizer=None):
    """The transformers config of `model` (a ParallelLMHeadModel)."""
    from qkvflow.hf.configuration_qkvflow import QkvflowParallelGpt2Config, QkvflowParallelLlamaConfig

    config = model.config
    if config.flavour == "llama" and type(config.rope) is not DefaultRotaryEmbeddingsConfig:
        raise UserError(
            f"model.rope={type(config.rope).__name__} is not supported by the export: expected rope type default"
        )
    cls = QkvflowParallelGpt2Config if config.flavour == "gpt2" else QkvflowParallelLlamaConfig
    special = {}
    if tokenizer is not None:
        special = {f"{n}_token_id": getattr(tokenizer, f"{n}_token_id") for n in ("bos", "eos", "pad")}
    hf = cls(
        vocab_size=model.Vocab.size,
        hidden_size=config.hidden_dim,
        num_attention_heads=config.num_heads,
        num_hidden_layers=config.num_layers,
        intermediate_size=config.mlp_dim,
        max_position_embeddings=config.seq_len,
        layer_norm_eps=config.layer_norm_epsilon,
        hidden_act="silu" if config.flavour == "llama" else config.activation_function.value,
        attention_bias=config.has_attention_bias,
        mlp_bias=config.has_mlp_bias,
        rope_theta=float(config.rope.theta),
        rope_scaling_factor=float(getattr(config.rope, "factor", 1.0)),
        initializer_range=config.initializer_range,
        tie_word_embeddings=config.tied_embeddings,
        ode_steps=ode_steps,
        **special,
    )
    name = "Gpt2" if config.flavour == "gpt2" else "Llama"
    hf.architectures = [f"QkvflowParallel{name}ForCausalLM"]
    hf.auto_map = {
        "AutoConfig": f"configuration_qkvflow.QkvflowParallel{name}Config",
        "AutoModelForCausalLM": f"modeling_qkvflow.QkvflowParallel{name}ForCausalLM",
    }
    return hf


def torch_state_dict(model) -> dict[str, np.ndarray]:
    state = to_torch_compatible_state_dict(model)
    return {k: np.ascontiguousarray(np.asarray(v, dtype=np.float32)) for k, v in state.items() if v is not None}


def save_hf_folder(model, folder: str, *, tokenizer=None, ode_steps=None) -> list[str]:
    """Write `model` to `folder` (which must exist); return the files written."""
    from safetensors.numpy import save_file
    from transformers import GenerationConfig

    config = hf_config(model, ode_steps=ode_steps, tokenizer=tokenizer)
    config.save_pretrained(folder)
    save_file(torch_state_dict(model), os.path.join(folder, WEIGHTS_FILE), metadata={"format": "pt"})
    for name in ("configuration_qkvflow.py", "modeling_qkvflow.py"):
        shutil.copyfile(os.path.join(HF_DIR, name), os.path.join(folder, name))
    GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
        use_cache=False,
    ).save_pretrained(folder)
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)
    return sorted(os.path.join(folder, f) for f in os.listdir(folder))
