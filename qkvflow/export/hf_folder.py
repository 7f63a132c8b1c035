"""Write a discrete `ParallelLMHeadModel` as a Hugging Face model folder.

config.json               QkvflowParallel{Gpt2,Llama}Config + auto_map -> the two .py files below
model.safetensors         torch state dict: haliax's to_torch_compatible_state_dict of the model
                          (its module names are the torch ones; see qkvflow.models.discrete.model)
configuration_qkvflow.py  copied from qkvflow/hf, so trust_remote_code works without qkvflow
modeling_qkvflow.py
generation_config.json    special token ids; use_cache false (the torch model keeps no cache)
tokenizer files           when a tokenizer is given, as `prompt_tokenizer` makes it
"""

import copy
import json
import logging
import os
import shutil

import numpy as np
from haliax.state_dict import to_torch_compatible_state_dict
from levanter.layers.rotary import DefaultRotaryEmbeddingsConfig

from qkvflow.errors import UserError

HF_DIR = os.path.join(os.path.dirname(__file__), "hf")
WEIGHTS_FILE = "model.safetensors"
logger = logging.getLogger("qkvflow.export.hf_folder")


def prompt_tokenizer(tokenizer):
    """`tokenizer` as users of an exported model need it: encoding a prompt appends no EOS.

    qkvflow's corpus tokenizers frame every text as `<eos> text <eos>`, so that Levanter's training
    data carries document boundaries (qkvflow.data.corpora); training must keep seeing exactly those
    ids. A prompt encoded that way ends with "end of document", and `model.generate(**tokenizer(prompt))`
    continues with EOS and stops at once. The returned copy keeps the leading BOS (a prompt starts as
    every training document does) and drops the EOS tokens that end its post-processor's templates.
    A tokenizer that appends no EOS is returned unchanged; one that does in a way this cannot undo
    (not a TemplateProcessing post-processor) is returned unchanged with a warning.
    """
    if not _appends_eos(tokenizer):
        return tokenizer
    backend = getattr(tokenizer, "backend_tokenizer", None)
    state = json.loads(backend.to_str()) if backend is not None else {}
    if _drop_trailing_eos(state.get("post_processor"), tokenizer.eos_token_id):
        from tokenizers import Tokenizer

        fixed = copy.deepcopy(tokenizer)
        fixed.backend_tokenizer.post_processor = Tokenizer.from_str(json.dumps(state)).post_processor
        if not _appends_eos(fixed):
            return fixed
    logger.warning(
        "the exported tokenizer appends %s to every text: pass add_special_tokens=False when encoding prompts "
        "for generation",
        tokenizer.eos_token,
    )
    return tokenizer


def _appends_eos(tokenizer) -> bool:
    """Whether encoding a text ends with EOS (the probe Levanter's BatchTokenizer uses)."""
    return tokenizer.eos_token_id is not None and tokenizer("hi there")["input_ids"][-1] == tokenizer.eos_token_id


def _drop_trailing_eos(processor, eos_id: int) -> bool:
    """Remove EOS from the ends of the templates in a post-processor's JSON; whether any was removed."""
    if not processor:
        return False
    if processor.get("type") == "Sequence":
        return any([_drop_trailing_eos(p, eos_id) for p in processor.get("processors", [])])
    if processor.get("type") != "TemplateProcessing":
        return False
    specials = processor.get("special_tokens", {})

    def is_eos(piece) -> bool:
        name = piece.get("SpecialToken", {}).get("id")
        return name is not None and specials.get(name, {}).get("ids") == [eos_id]

    dropped = False
    for key in ("single", "pair"):
        template = processor.get(key) or []
        while template and is_eos(template[-1]):
            template.pop()
            dropped = True
    return dropped


def hf_config(model, *, ode_steps=None, tokenizer=None):
    """The transformers config of `model` (a ParallelLMHeadModel)."""
    from qkvflow.export.hf import configuration_qkvflow

    config = model.config
    flavour = config.flavour_spec
    if config.sequential:
        raise UserError(
            "model.type=sequential_gpt2 is not supported by the export: expected a parallel family "
            "(the Hugging Face model runs the parallel block)"
        )
    if config.block_scheme != "euler":
        raise UserError(
            f"model.block_scheme={config.block_scheme} is not supported by the export: expected euler "
            "(the Hugging Face model runs x + F(x) per layer)"
        )
    if flavour.rotary and type(config.rope) is not DefaultRotaryEmbeddingsConfig:
        raise UserError(
            f"model.rope={type(config.rope).__name__} is not supported by the export: expected rope type default"
        )
    name = flavour.hf_name
    cls = getattr(configuration_qkvflow, f"QkvflowParallel{name}Config")
    special = {}
    if tokenizer is not None:
        special = {f"{n}_token_id": getattr(tokenizer, f"{n}_token_id") for n in ("bos", "eos", "pad")}
    hf = cls(
        vocab_size=model.Vocab.size,
        hidden_size=config.hidden_dim,
        num_attention_heads=config.num_heads,
        num_hidden_layers=config.num_layers,
        intermediate_size=config.mlp_dim,
        max_position_embeddings=config.max_seq_len,
        layer_norm_eps=config.layer_norm_epsilon,
        hidden_act=flavour.hidden_act(config.activation_function),
        attention_bias=config.has_attention_bias,
        mlp_bias=config.has_mlp_bias,
        rope_theta=float(config.rope.theta),
        rope_scaling_factor=float(getattr(config.rope, "factor", 1.0)),
        initializer_range=config.initializer_range,
        tie_word_embeddings=config.tied_embeddings,
        ode_steps=ode_steps,
        **special,
    )
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
        prompt_tokenizer(tokenizer).save_pretrained(folder)
    return sorted(os.path.join(folder, f) for f in os.listdir(folder))
