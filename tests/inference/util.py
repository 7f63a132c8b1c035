"""Shared pieces of the inference tests: a character tokenizer, tiny models and the uncached reference."""

import dataclasses

import equinox as eqx
import haliax as hax
import jax.numpy as jnp
import jax.random as jrandom
import numpy as np

from qkvflow.integrate.config import OdeConfig
from qkvflow.models import registry
from tests.helpers import Vocab, tiny_config, tiny_model

CONTEXT = 16
EPS = float(np.finfo(np.float32).eps)


class CharTokenizer:
    """One token per character: code point - 32, so printable ASCII maps into the 61-token vocabulary."""

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [ord(c) - 32 for c in text]}

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(i + 32) for i in ids)

    def __len__(self):
        return Vocab.size


def ode_model(flavour, solver, steps, seed=0):
    return tiny_model(tiny_config(flavour, ode=OdeConfig(num_steps=steps, solver=solver), max_seq_len=CONTEXT), seed)


def on_grid(model, steps):
    """The same weights, integrated on `steps` steps: what decoding at N' must equal (built here, by
    replacing the config's ode.num_steps, not by the code under test)."""
    ode = dataclasses.replace(model.config.ode, num_steps=steps)
    return dataclasses.replace(model, _config=dataclasses.replace(model.config, ode=ode))


def parallel_model(flavour, layers=3, seed=0):
    config = registry.family(f"parallel_{flavour}").config_class(
        max_seq_len=CONTEXT, hidden_dim=32, num_heads=4, num_layers=layers
    )
    return config.build(Vocab, key=jrandom.PRNGKey(seed))


@eqx.filter_jit
def _forward(model, ids):
    return model(ids)


def full_logits(model, tokens: list[int], context: int = CONTEXT) -> np.ndarray:
    """Logits [len(tokens), vocab] of the uncached full-sequence forward. The sequence is padded to the
    context (the model is causal, so padding after position i cannot change its logits) so that every
    prefix length runs the same compiled forward."""
    padded = np.zeros(context, dtype=np.int32)
    padded[: len(tokens)] = tokens
    logits = _forward(model, hax.named(jnp.asarray(padded), "position"))
    return np.asarray(logits.array)[: len(tokens)]


def training_framed(tokenizer, text: str) -> list[int]:
    """The ids of `text` as the start of a training document: what Levanter's own document tokenizer (the
    one that built the training caches) makes of it, without the end marker it appends after a document."""
    from levanter.data.text._batch_tokenizer import BatchTokenizer

    return list(BatchTokenizer(tokenizer, enforce_eos=False)([{"text": text}])[0]["input_ids"])


def greedy_reference(model, prompt: list[int], new: int, context: int = CONTEXT) -> tuple[list[int], float]:
    """Greedy decoding without a cache: re-run the whole prefix at every step and take the argmax of
    the last position's logits. Also returns the smallest top-1/top-2 logit margin met on the way,
    relative to the largest logit (to compare with `round_off(..., scale=1)`)."""
    tokens, margin = list(prompt), np.inf
    for _ in range(new):
        last = full_logits(model, tokens, context)[-1]
        top2 = np.sort(last)[-2:]
        margin = min(margin, float(top2[1] - top2[0]) / float(np.abs(last).max()))
        tokens.append(int(np.argmax(last)))
    return tokens[len(prompt) :], margin


def round_off(nfe: int, hidden: int, scale: float) -> float:
    """Tolerance for cached vs uncached logits. Both compute the same operations in float32 but in a
    different order (the paged kernel's blockwise online softmax against one softmax over the full
    row; the stage sums in another order than diffrax's), so each evaluation adds a relative
    difference of a few eps, from dot products of length `hidden` (round-off growing like
    sqrt(hidden)), and the differences add up over the `nfe` evaluations: eps * nfe * sqrt(hidden),
    relative to the largest logit."""
    return EPS * nfe * np.sqrt(hidden) * scale
