"""Small models shared by the tests."""

import haliax as hax
import jax.random as jrandom
from haliax import Axis

from qkvflow.integrate.config import OdeConfig
from qkvflow.models.diffeqformer import DiffEqFormerGpt2Config, DiffEqFormerLlamaConfig

FLAVOURS = {"gpt2": DiffEqFormerGpt2Config, "llama": DiffEqFormerLlamaConfig}
Vocab = Axis("vocab", 61)
Batch = Axis("batch", 2)


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
    """The dataclass a shipped YAML is written for: a fine-tuning config names its `pretrained` model."""
    import yaml

    from qkvflow.training.config import TrainConfig
    from qkvflow.training.finetune import FinetuneConfig

    with open(path) as f:
        content = yaml.safe_load(f)
    return FinetuneConfig if isinstance(content, dict) and "pretrained" in content else TrainConfig
