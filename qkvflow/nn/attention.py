"""One attention kernel for both sides of a comparison: the DiffEqFormer's field and Levanter's GPT-2/Llama.

All of them compute softmax(q k^T / sqrt(d) + mask) v through Levanter's `dot_product_attention`, which
picks a kernel from the model config's `attn_backend` (Levanter's `AttentionBackend`: default, nvte,
splash, jax_flash, vanilla). On a GPU Levanter's default is Transformer Engine's fused attention and,
where `transformer_engine` is not installed, its blockwise pure-JAX flash attention; it has no route to
`jax.nn.dot_product_attention`, whose `cudnn` implementation is cuDNN's fused flash attention. This
module adds two kernels by that function:

- `cudnn`: `jax.nn.dot_product_attention(implementation="cudnn")`, GPU only, bf16/fp16 inputs;
- `xla`: `jax.nn.dot_product_attention(implementation="xla")`, jax's reference, any backend;

and `auto`, the fastest known for the platform and compute dtype (`fastest`). A config that leaves
`attn_backend` unset (Levanter's default) runs the process-wide choice, `$QKVFLOW_ATTENTION` (default
`auto`), so every model of a process, and every run `bench compare` starts, runs the same kernel;
an explicit `attn_backend` is kept. Levanter has no registry for attention kernels (the backend is a
closed enum matched inside `dot_product_attention`), so `install()` wraps that function where
Levanter's models look it up (`levanter.layers.attention`, used by Llama's attention, and
`levanter.models.gpt2`); calls that end up on Levanter's own choice go to its function unchanged.
"""

import functools
import importlib
import inspect
import math
import os
import sys

import haliax as hax
import jax
import jax.numpy as jnp
from levanter.layers.attention import AttentionBackend, AttentionMask, default_attention_type

OURS = ("cudnn", "xla")
CHOICES = ("auto", *OURS, *(b.value for b in AttentionBackend if b is not AttentionBackend.DEFAULT))
"""`--attention` values: auto, qkvflow's kernels, Levanter's explicit backends."""

ENV = "QKVFLOW_ATTENTION"
"""The process-wide kernel for configs that leave `attn_backend` unset (default: auto)."""

MODULES = ("levanter.layers.attention", "levanter.models.gpt2")
"""Where Levanter's models look `dot_product_attention` up (gpt2 imported it by name)."""


def fastest(platform: str, dtype, head_size: int | None = None) -> str:
    """The kernel `auto` means. GPU: cuDNN's fused flash attention for 16-bit inputs with a head size it
    takes (a multiple of 8, at most 128), else jax's XLA reference (not yet measured on an accelerator);
    TPU: Levanter's splash attention (its default there); CPU: Levanter's default there, its blockwise
    jax_flash, which none of the others beat measurably on the 2-core CPU (`benchmarks/attention_cpu.py`,
    docs/benchmarks.md)."""
    if platform == "gpu":
        fits = head_size is None or (head_size % 8 == 0 and head_size <= 128)
        return "cudnn" if jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16) and fits else "xla"
    if platform == "tpu":
        return AttentionBackend.SPLASH.value
    return AttentionBackend.JAX_FLASH.value


def resolve(choice: str, dtype, platform: str | None = None, head_size: int | None = None) -> str:
    """`choice` (one of CHOICES) with `auto` replaced by `fastest` for `platform` (default: Levanter's
    notion, the first local device's)."""
    if choice not in CHOICES:
        raise ValueError(f"attention kernel {choice!r} is unknown: expected one of {', '.join(CHOICES)}")
    if choice != "auto":
        return choice
    return fastest(platform or jax.local_devices()[0].platform, dtype, head_size)


def process_choice() -> str:
    """`$QKVFLOW_ATTENTION`, default auto; an unknown value is refused in one line."""
    choice = os.environ.get(ENV) or "auto"
    if choice not in CHOICES:
        raise ValueError(f"{ENV}={choice!r} is unknown: expected one of {', '.join(CHOICES)}")
    return choice


def config_value(kernel: str):
    """What a model config's `attn_backend` holds for `kernel`: Levanter's enum member, or our name."""
    return kernel if kernel in OURS else AttentionBackend(kernel)


def jax_nn_attention(QPos, KPos, Key, query, key, value, mask=None, *, implementation: str, scaling_factor=None):
    """softmax(q k^T * scale + mask) v over KPos by `jax.nn.dot_product_attention`, for named arrays.

    Every axis of `query` other than QPos and Key is a batch axis (batch, heads, ...); keys and values
    are broadcast over the ones they lack (grouped heads). A causal AttentionMask without segments or
    offsets is passed as `is_causal` (cuDNN's causal kernel, no mask in memory); any other mask is
    materialised (Levanter's `AttentionMask.materialize`) over its own axes and broadcast over the rest."""
    QPos, KPos, Key = query.resolve_axis(QPos), key.resolve_axis(KPos), query.resolve_axis(Key)
    is_causal, dense = False, None
    if isinstance(mask, AttentionMask):
        plain = mask.explicit_mask is None and mask.segment_ids is None and mask.sliding_window is None
        if mask.is_causal and plain and mask.causal_offset is None:
            is_causal = True
        else:
            dense = mask.materialize(QPos, KPos)
    elif mask is not None:
        dense = mask
    batch = [ax for ax in query.axes if ax.name not in (QPos.name, Key.name)]
    outer = [ax for ax in batch if dense is not None and ax.name in dense.axis_names]
    inner = [ax for ax in batch if ax not in outer]
    (VKey,) = [ax for ax in value.axes if ax.name not in (KPos.name, *(a.name for a in batch))]

    def flat(x, Pos, Feature):
        missing = tuple(ax for ax in batch if ax.name not in x.axis_names)
        x = x.broadcast_axis(missing) if missing else x
        x = x.rearrange((*outer, Pos, *inner, Feature)).array
        return x.reshape(math.prod(a.size for a in outer), Pos.size, math.prod(a.size for a in inner), Feature.size)

    q, k, v = flat(query, QPos, Key), flat(key, KPos, Key), flat(value, KPos, VKey)
    m = None
    if dense is not None:
        missing = tuple(ax for ax in outer if ax.name not in dense.axis_names)
        dense = dense.broadcast_axis(missing) if missing else dense
        m = dense.broadcast_axis(tuple(ax for ax in (QPos, KPos) if ax.name not in dense.axis_names))
        m = m.rearrange((*outer, QPos, KPos)).array.reshape(q.shape[0], 1, QPos.size, KPos.size)
    out = jax.nn.dot_product_attention(
        q, k, v, mask=m, scale=scaling_factor, is_causal=is_causal, implementation=implementation
    )
    out = out.reshape(*(a.size for a in outer), QPos.size, *(a.size for a in inner), VKey.size)
    return hax.named(out, (*outer, QPos, *inner, VKey))


UNSUPPORTED = ("bias", "logits_soft_cap", "attn_sink")


def kernel_for(backend, use_flash, dtype, head_size: int) -> str | None:
    """The kernel a call runs: its explicit `attn_backend`; for an unset one (None or default, and
    use_flash not False) the process-wide choice resolved. None: Levanter's own choice, left to it."""
    if backend is not None and backend != AttentionBackend.DEFAULT:
        return str(backend.value if isinstance(backend, AttentionBackend) else backend)
    if use_flash is False:
        return None
    kernel = resolve(process_choice(), dtype, head_size=head_size)
    return None if kernel == default_attention_type().value else kernel


def _wrap(original):
    signature = inspect.signature(original)

    @functools.wraps(original)
    def dot_product_attention(*args, **kwargs):
        a = signature.bind(*args, **kwargs).arguments
        q, k, v = a["query"], a["key"], a["value"]
        head_size = q.resolve_axis(a["Key"]).size
        kernel = kernel_for(a.get("attn_backend"), a.get("use_flash"), a.get("attention_dtype") or q.dtype, head_size)
        if kernel not in OURS:
            if kernel is None or kernel == a.get("attn_backend"):
                return original(*args, **kwargs)
            return original(**{**a, "attn_backend": AttentionBackend(kernel)})
        for name in UNSUPPORTED:
            if a.get(name) is not None:
                raise NotImplementedError(f"attention kernel {kernel!r} does not take {name}: use attn_backend vanilla")
        if a.get("dropout", 0.0) and not a.get("inference", True):
            raise NotImplementedError(f"attention kernel {kernel!r} has no dropout: use attn_backend vanilla")
        dtype = a.get("attention_dtype")
        if dtype is not None:
            q, k, v = q.astype(dtype), k.astype(dtype), v.astype(dtype)
        return jax_nn_attention(
            a["QPos"], a["KPos"], a["Key"], q, k, v, a.get("mask"),
            implementation=kernel, scaling_factor=a.get("scaling_factor"),
        )  # fmt: skip

    dot_product_attention.__qkvflow_original__ = original
    return dot_product_attention


def install() -> None:
    """Route `attn_backend` cudnn/xla in Levanter's models here (idempotent).

    Only modules already imported are wrapped: one imported later takes the wrapped function from
    `levanter.layers.attention` by name, and importing `levanter.models.gpt2` here would undo the parse
    shortcut (`qkvflow.models.registry.only_named_types`)."""
    for name in MODULES:
        module = sys.modules.get(name) or (importlib.import_module(name) if name == MODULES[0] else None)
        if module is None:
            continue
        current = module.dot_product_attention
        if not hasattr(current, "__qkvflow_original__"):
            module.dot_product_attention = _wrap(current)


install()
dot_product_attention = importlib.import_module("levanter.layers.attention").dot_product_attention
"""Levanter's function with qkvflow's kernels routed in: what qkvflow's own fields call."""
