"""Read a trained model back from a `qkvflow train` checkpoint (for analysis, export, benchmarks).

Levanter checkpoints hold the whole trainer state; this loads only its `model` subtree into the
shape that the run's config builds, on the local devices.
"""

import equinox as eqx
import jax
import numpy as np
import jax.random as jrandom
import levanter.checkpoint
from haliax import Axis

from qkvflow.config import TrainConfig
from qkvflow.errors import UserError


def load_model(config: TrainConfig, checkpoint: str, *, vocab_size: int | None = None):
    """(model, tokenizer) from `checkpoint`: a `step-N` folder, or a run folder (its newest step).

    The vocabulary size comes from the config's tokenizer unless `vocab_size` is given.
    """
    from qkvflow.train import with_corpus

    config = with_corpus(config)
    tokenizer = config.data.the_tokenizer
    path = levanter.checkpoint.discover_latest_checkpoint(checkpoint)
    if path is None:
        raise UserError(f"checkpoint {checkpoint!r}: no checkpoint found (expected checkpoints/<run_id>[/step-N])")
    Vocab = Axis("vocab", vocab_size or len(tokenizer))
    shape = eqx.filter_eval_shape(config.model.build, Vocab, key=jrandom.PRNGKey(0))
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("data",))
    try:
        with jax.set_mesh(mesh):
            model = levanter.checkpoint.load_checkpoint(shape, path, subpath="model", discover_latest=False, mesh=mesh)
    except (KeyError, ValueError, FileNotFoundError) as e:
        raise UserError(
            f"checkpoint {path!r} does not hold a {type(config.model).__name__} model with vocabulary "
            f"{Vocab.size} as the config describes ({type(e).__name__}: {str(e).splitlines()[0][:200]})"
        ) from e
    return model, tokenizer
