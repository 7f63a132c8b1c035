"""Small models shared by the tests."""

import os

import haliax as hax
import jax.random as jrandom
from haliax import Axis

from qkvflow.integrate.config import OdeConfig
from qkvflow.models.diffeqformer import DiffEqFormerGpt2Config, DiffEqFormerLlamaConfig

FLAVOURS = {"gpt2": DiffEqFormerGpt2Config, "llama": DiffEqFormerLlamaConfig}
Vocab = Axis("vocab", 61)
Batch = Axis("batch", 2)


def with_host_devices(devices: int) -> str:
    """XLA_FLAGS for a subprocess that sees `devices` CPU devices, keeping the session's own flags
    (tests/conftest.py)."""
    return f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices}".strip()


def tiny_config(flavour="gpt2", *, ode=None, **overrides):
    kwargs = dict(max_seq_len=12, hidden_dim=32, num_heads=4, time_embed_dim=8, num_frequencies=16)
    kwargs.update(overrides)
    return FLAVOURS[flavour](ode=ode or OdeConfig(num_steps=4), **kwargs)


def tiny_model(config, seed=0):
    return config.build(Vocab, key=jrandom.PRNGKey(seed))


def random_tokens(config, seed=1, batch=Batch):
    return hax.random.randint(jrandom.PRNGKey(seed), (batch, config.max_Pos), 0, Vocab.size)


def smooth_model(config, seed=0):
    """A model whose flow is non-stiff: unit-scale token embeddings (see test_solvers_converge...)."""
    import equinox as eqx

    model = tiny_model(config, seed)
    return eqx.tree_at(lambda m: m.token_embeddings.weight, model, model.token_embeddings.weight * 10)


def config_class(path):
    """The dataclass a shipped YAML is written for: a fine-tuning config names its `pretrained` model; a
    config for `qkvflow plan` alone sets the vocabulary its model is built with (`vocab_size`)."""
    import yaml

    from qkvflow.finetune.run import FinetuneConfig
    from qkvflow.plan.config import PlanConfig
    from qkvflow.runs.config import TrainConfig

    with open(path) as f:
        content = yaml.safe_load(f)
    if isinstance(content, dict) and "pretrained" in content:
        return FinetuneConfig
    return PlanConfig if isinstance(content, dict) and "vocab_size" in content else TrainConfig


def parse_config(path, cls=None, args=()):
    """The config file `path` with the overrides `args`, read as the verb that takes `cls` (default
    TrainConfig) reads it: `qkvflow.runs.configfile.parse`, which imports only the model types the file names
    and reuses its parser (a first `draccus.parse` in a process searches every Levanter model, ~12 s)."""
    from qkvflow.cli.describe import DescribeConfig
    from qkvflow.finetune.run import FinetuneConfig
    from qkvflow.runs import configfile
    from qkvflow.runs.config import TrainConfig

    cls = TrainConfig if cls is None else cls
    verb = {FinetuneConfig: "finetune", DescribeConfig: "describe"}.get(cls, "train")
    return configfile.parse(cls, ["--config_path", str(path), *args], verb)


def logit_tolerance(layers: int, hidden: int) -> float:
    """Relative logit error (max |a - b| / max |b|) allowed between two float32 implementations of the same
    model, e.g. the torch export and the JAX model: they sum the same products in other orders. Each sum
    of n float32 terms in another order differs by about sqrt(n) ulps (random-walk round-off), and the
    layers add their errors, so with n ~ hidden per dot product: 4 ulps * sqrt(layers * hidden), 4 as a
    margin. Measured (tests/hf/test_export.py, 4 layers, hidden 32): 1.3 to 2.5 ulps, against 45 allowed;
    the 1e-4 used before was 840 ulps and let a norm without its epsilon through."""
    import math

    import numpy as np

    return 4 * float(np.finfo(np.float32).eps) * math.sqrt(layers * hidden)


def shared_path(tmp_path_factory, name: str):
    """A folder that every test process of this run shares, and the lock to hold while filling it:
    under pytest-xdist (`-n 2`, as CI runs) each worker has its own base temp folder, so the shared
    one is their common parent; without xdist it is the run's base temp folder. For what is built
    once and then only read (a trained checkpoint); the corpus stays per process, since every
    training run may add to its Levanter cache."""
    from filelock import FileLock

    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent
    return base / name, FileLock(str(base / f"{name}.lock"))
