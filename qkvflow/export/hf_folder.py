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
from qkvflow.export.hf import configuration_qkvflow

HF_DIR = os.path.join(os.path.dirname(__file__), "hf")
WEIGHTS_FILE = "model.safetensors"
logger = logging.getLogger("qkvflow.export.hf_folder")


def prompt_tokenizer(tokenizer):
    """`tokenizer` as users of an exported model need it: ``tokenizer(text)`` gives the ids of a prompt
    framed as training framed a document's start, ``[bos] + encode(text)`` (`qkvflow.inference.generate.
    frame_prompt`), with no end marker.

    Levanter's `BatchTokenizer` encodes every training document as ``[bos] + encode(text + " " + eos)``
    whatever the tokenizer's own templates say. qkvflow's corpus tokenizers frame every text as
    `<eos> text <eos>`: a prompt encoded that way ends with "end of document", and
    `model.generate(**tokenizer(prompt))` continues with EOS and stops at once, so the copy drops the
    EOS tokens that end its post-processor's templates. A tokenizer with a BOS token that its templates
    do not add (GPT-2's) gets a template that prepends it. A tokenizer already framed this way is
    returned unchanged; one that cannot be changed this way (no fast backend, a post-processor this
    does not read) is returned unchanged with a warning.
    """
    if not _appends_eos(tokenizer) and _prepends_bos(tokenizer):
        return tokenizer
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        from tokenizers import Tokenizer

        state = json.loads(backend.to_str())
        fixed = copy.deepcopy(tokenizer)
        if _appends_eos(tokenizer) and _drop_trailing_eos(state.get("post_processor"), tokenizer.eos_token_id):
            fixed.backend_tokenizer.post_processor = Tokenizer.from_str(json.dumps(state)).post_processor
        if not _prepends_bos(fixed):
            _prepend_bos(fixed)
        if not _appends_eos(fixed) and _prepends_bos(fixed):
            return fixed
    logger.warning(
        "the exported tokenizer does not encode a prompt as training framed a document's start (BOS, then "
        "the text, no EOS): frame prompts for generation yourself (qkvflow.inference.generate.frame_prompt)"
    )
    return tokenizer


def _prepends_bos(tokenizer) -> bool:
    """Whether encoding a text starts with BOS (true of a tokenizer without one)."""
    bos = tokenizer.bos_token_id
    return bos is None or tokenizer("hi there")["input_ids"][:1] == [bos]


def _prepend_bos(tokenizer) -> None:
    """Run a template that puts BOS first after the backend's own post-processor (GPT-2's ByteLevel one
    only fixes offsets)."""
    from tokenizers import processors

    bos, bos_id = tokenizer.bos_token, tokenizer.bos_token_id
    template = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A $B", special_tokens=[(bos, bos_id)])
    backend = tokenizer.backend_tokenizer
    own = backend.post_processor
    backend.post_processor = template if own is None else processors.Sequence([own, template])


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
