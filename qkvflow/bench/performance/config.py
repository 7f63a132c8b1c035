"""What `qkvflow bench speed` times: the DiffEqFormer config of a file, with the command line's changes.

`load_config` reads the `model:` section of a train or bench config (an ODE model, else one line naming
the file) and the defaults the file gives for the batch and the vocabulary (`bench:`, the trainer's batch,
the corpus's vocabulary). `apply_overrides` sets the ODE options `bench scaling` varies per point and the
depth-dial recipes of `--dial`; `with_attention` gives every benchmarked model the same attention kernel
(qkvflow.nn.attention), the one `--attention` resolves to for the backend and compute dtype.
"""

import dataclasses
from pathlib import Path

import jax.numpy as jnp
import yaml

from qkvflow.errors import UserError
from qkvflow.models import registry
from qkvflow.models.depth_dial import DepthDialConfig
from qkvflow.nn import attention
from qkvflow.runs.compat import check_config

CORPUS_VOCAB = {"tinyshakespeare": 66, "pydoc": 2048}


def load_config(path: str) -> tuple:
    """(DiffEqFormer config, defaults from the file: batch, vocab_size)."""
    file = Path(path)
    if not file.is_file():
        raise UserError(f"{path}: no such config file")
    check_config(path)  # Levanter 1.2 keys (model.seq_len, ...): one line naming the replacement
    try:
        raw = yaml.safe_load(file.read_text()) or {}
    except yaml.YAMLError as e:
        raise UserError(f"{path} is not valid YAML: {e}") from None
    if not isinstance(raw, dict) or not isinstance(raw.get("model"), dict):
        raise UserError(f"{path}: needs a `model:` section (a diffeqformer_* or shared_ode_* model)")
    model = registry.decode(raw["model"])
    if not registry.is_ode(model):
        raise UserError(
            f"{path}: model.type must be an ODE model (diffeqformer_*/shared_ode_*), got {raw['model'].get('type')!r}"
        )
    bench = raw.get("bench") or {}
    corpus = raw.get("corpus") or {}
    batch = bench.get("batch") or (raw.get("trainer") or {}).get("train_batch_size") or 8
    vocab = bench.get("vocab_size") or corpus.get("vocab_size") or CORPUS_VOCAB.get(corpus.get("name"), 50257)
    return model, {"batch": int(batch), "vocab_size": int(vocab)}


def with_attention(models: dict, choice: str, dtype: str) -> tuple[dict, str]:
    """Every model config with `attn_backend` set to the kernel `choice` resolves to for `dtype` (the same
    one for all): the models and the kernel's name."""
    heads = {c.hidden_dim // c.num_heads for c in models.values()}
    kernel = attention.resolve(
        choice, jnp.bfloat16 if dtype == "bf16" else jnp.float32, head_size=heads.pop() if len(heads) == 1 else None
    )
    value = attention.config_value(kernel)
    return {name: dataclasses.replace(c, attn_backend=value) for name, c in models.items()}, kernel


def apply_overrides(model, args):
    ode = model.ode
    changes = {k: getattr(args, k) for k in ("num_steps", "solver", "adjoint", "checkpoints", "weight_cache", "loop")}
    changes = {k: v for k, v in changes.items() if v is not None}
    if changes:
        ode = dataclasses.replace(ode, **changes)
    top = {"ode": ode}
    if args.seq_len is not None:
        top["max_seq_len"] = args.seq_len
    if args.time_embed_dim is not None:
        top["time_embed_dim"] = args.time_embed_dim
    if getattr(args, "dial", None) is not None:
        top["dial"] = dial_config(args.dial)
    return dataclasses.replace(model, **top)


def dial_config(text: str):
    """`--dial`'s YAML mapping as a `DepthDialConfig`; one line naming the option otherwise."""
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError:
        raw = None
    names = [f.name for f in dataclasses.fields(DepthDialConfig)]
    if not isinstance(raw, dict) or set(raw) - set(names):
        raise UserError(f"--dial {text!r} is invalid: expected a YAML mapping with keys among {names}")
    if "train_steps" in raw:
        raw["train_steps"] = tuple(raw["train_steps"] or ())
    return DepthDialConfig(**raw)
