"""The halting phase of the Depth-Adaptive Transformer in `qkvflow train` (`qkvflow.models.related.halting`).

A `halting_gpt2` config with `halting.kind: geometric | multinomial` trains only its halting head on
top of an aligned `adaptive_gpt2` model of the same shape:

    trainer.initialize_from: checkpoints/<aligned run>[/step-N]     (the newest step-N of a run folder)

`prepare` loads that checkpoint's trunk and exits into the halting model (a new head), and returns
Levanter's trainable filter: only the head's arrays are trainable, so the optimizer holds state only
for them and the trunk and exits stay bit-identical (weight decay included); the loss also reads them
through stop_gradient. Levanter saves only trainable arrays, so a resumed halting run rebuilds the
trunk from `trainer.initialize_from` again: keep it in the command. The trainer itself is given
`initialize_from: null` (Levanter would otherwise look for the head in the aligned checkpoint).
"""

import dataclasses

import equinox as eqx
import jax
import jax.random as jrandom
import levanter.checkpoint
import numpy as np
from haliax import NamedArray

from qkvflow.errors import UserError, check
from qkvflow.models.related.halting import HaltingGpt2Config, HaltingLMHeadModel


def is_halting_phase(model_config) -> bool:
    return isinstance(model_config, HaltingGpt2Config) and model_config.halting.kind != "none"


def trainable_filter(model: HaltingLMHeadModel):
    """True on the halting head's leaves, False everywhere else (Levanter's `is_trainable`)."""
    is_named = lambda x: isinstance(x, NamedArray)  # noqa: E731  (one flag per named array, a prefix of the model)
    frozen = jax.tree_util.tree_map(lambda _: False, model, is_leaf=is_named)
    head = jax.tree_util.tree_map(lambda _: True, model.halting_head, is_leaf=is_named)
    return eqx.tree_at(lambda m: m.halting_head, frozen, head)


def load_exits_model(model_config: HaltingGpt2Config, Vocab, checkpoint: str):
    """The aligned `adaptive_gpt2` model of `model_config`'s shape from `checkpoint` (a run or step-N folder)."""
    path = levanter.checkpoint.discover_latest_checkpoint(checkpoint)
    if path is None:
        raise UserError(
            f"trainer.initialize_from={checkpoint!r} is invalid: expected the aligned adaptive_gpt2 run's "
            "checkpoint folder (checkpoints/<run_id>[/step-N])"
        )
    exits_config = model_config.exits_config()
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("data",))
    try:
        with jax.set_mesh(mesh):
            shape = eqx.filter_eval_shape(exits_config.build, Vocab, key=jrandom.PRNGKey(0))
            return levanter.checkpoint.load_checkpoint(shape, path, subpath="model", mesh=mesh)
    except (KeyError, ValueError, FileNotFoundError) as e:
        raise UserError(
            f"trainer.initialize_from={checkpoint!r}: {path} does not hold an adaptive_gpt2 model of this config's "
            f"shape ({type(e).__name__}: {str(e).splitlines()[0][:200]})"
        ) from None


def prepare(config, Vocab, model_key):
    """(config, model, is_trainable) for `qkvflow train`: for a halting phase the loaded model, its
    filter and the config without `trainer.initialize_from`; otherwise (config, None, True)."""
    if not is_halting_phase(config.model):
        return config, None, True
    source = config.trainer.initialize_from
    check(source is not None, "trainer.initialize_from", source, "the aligned adaptive_gpt2 checkpoint to halt on")
    exits_model = load_exits_model(config.model, Vocab, source)
    model = HaltingLMHeadModel.from_exits_model(exits_model, config.model, key=model_key)
    config = dataclasses.replace(config, trainer=dataclasses.replace(config.trainer, initialize_from=None))
    return config, model, trainable_filter(model)
