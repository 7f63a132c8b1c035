"""The full ODE model (hypernetwork, embeddings, final norm) as safetensors plus a JSON config.

A folder written by `save_ode_export` holds

    config.json        {"format": "qkvflow-ode", "version": 2, "vocab_size": V,
                        "model": {"type": "diffeqformer_gpt2", ...every DiffEqFormerConfig field...},
                        "axes": {key: [named axes of the tensor, in stored order]}}
    model.safetensors  one tensor per key, float32, keys = the model's attribute paths:
        token_embeddings.weight [vocab, embed], position_embeddings.weight [position, embed] (GPT-2),
        final_norm.weight / .bias [embed], lm_head [embed, vocab] (untied only),
        hyper:  generator.weights.<w>.proj [time_embed, *axes of w]
                generator.weights.<w>.mlp.lin{1,2}.{weight,bias}  (or generator.shared_mlp.* when shared)
        shared: generator.constants.<w> [*axes of w], generator.time_bias.<w> [*output axes of w]

(the model stacks these hypernetworks, `qkvflow.models.layout`: an export stores them per weight, and
loading stacks them again), so W_w(t) = offset_w + proj_w . silu(L2(silu(L1(Sinusoidal(t))))) / d_emb (`qkvflow.nn.time_dependent`;
offset 1 for norm scales; with the config's time_embed_norm the silu output is first divided by its
RMS) or, shared, W_w = constants_w with bias constants_w_bias + time_bias_w * t.
`load_ode_export` rebuilds the `DiffEqFormerLMHeadModel`; its logits equal the original's.
"""

import json
import os

import haliax as hax
import jax.random as jrandom
import numpy as np
from haliax import Axis
from haliax.state_dict import from_state_dict, to_state_dict

from qkvflow.errors import UserError
from qkvflow.models import registry
from qkvflow.models.layout import per_weight_model, per_weight_shape, stacked_model

FORMAT, VERSION = "qkvflow-ode", 2
"""2: W(t) carries the 1/d_emb multiplier (qkvflow.nn.time_dependent); version-1 folders predate it."""
CONFIG_FILE, WEIGHTS_FILE = "config.json", "model.safetensors"


def _encode_config(config) -> dict:
    import draccus
    from levanter.models.lm_model import LmConfig

    fields = json.loads(json.dumps(draccus.encode(config), default=lambda o: getattr(o, "value", str(o))))
    return {"type": LmConfig.get_choice_name(type(config)), **fields}


def save_ode_export(model, folder: str) -> list[str]:
    """Write `model` (a DiffEqFormerLMHeadModel) to `folder`; return the paths written."""
    from safetensors.numpy import save_file

    os.makedirs(folder, exist_ok=True)
    model = per_weight_model(model)  # version 2 stores each weight's hypernetwork under its own name
    state = {k: v for k, v in to_state_dict(model).items() if v is not None}
    leaves = {k: np.ascontiguousarray(np.asarray(v, dtype=np.float32)) for k, v in state.items()}
    axes = {key: [a.name for a in leaf.axes] for key, leaf in _named_leaves(model)}
    meta = {"format": FORMAT, "version": VERSION, "vocab_size": model.Vocab.size, "model": _encode_config(model.config)}
    meta["axes"] = {k: axes[k] for k in leaves if k in axes}
    weights, config = os.path.join(folder, WEIGHTS_FILE), os.path.join(folder, CONFIG_FILE)
    save_file(leaves, weights, metadata={"format": "np"})
    with open(config, "w") as f:
        json.dump(meta, f, indent=2)
    return [config, weights]


def _named_leaves(model):
    """(state-dict key, NamedArray) for every named array in `model`."""
    import jax

    flat, _ = jax.tree_util.tree_flatten_with_path(model, is_leaf=hax.is_named_array)
    for path, leaf in flat:
        if hax.is_named_array(leaf):
            key = ".".join(_key_part(p) for p in path)
            yield key, leaf


def _key_part(p) -> str:
    for attr in ("name", "key", "idx"):
        if hasattr(p, attr):
            return str(getattr(p, attr))
    return str(p)


def load_ode_export(folder: str):
    """The DiffEqFormerLMHeadModel saved in `folder` by `save_ode_export`."""
    from safetensors.numpy import load_file

    path = os.path.join(folder, CONFIG_FILE)
    try:
        with open(path) as f:
            meta = json.load(f)
    except (OSError, ValueError) as e:
        raise UserError(f"{path}: cannot read an ODE export config ({e})") from None
    if meta.get("format") != FORMAT:
        raise UserError(f"{path}: format={meta.get('format')!r} is invalid: expected {FORMAT!r}")
    if meta.get("version") != VERSION:
        raise UserError(
            f"{path}: version={meta.get('version')!r} is invalid: expected {VERSION} (version 1 exports predate "
            "the 1/d_emb multiplier of W(t) and would give different logits; re-export from the checkpoint "
            "with the qkvflow that trained it)"
        )
    config = registry.decode(meta["model"])
    template = per_weight_shape(config.build, Axis("vocab", meta["vocab_size"]), key=jrandom.PRNGKey(0))
    return stacked_model(from_state_dict(template, load_file(os.path.join(folder, WEIGHTS_FILE))))
