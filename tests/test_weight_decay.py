"""The weight-decay mask, parameter by parameter, for every model type: ODE models decay what GPT-2's
default decays (the matrices, as their generators) and never a norm, a bias or their generators."""

import dataclasses

import equinox as eqx
import haliax as hax
import jax
import numpy as np
import pytest
from levanter.models.gpt2 import Gpt2Config
from levanter.models.llama import LlamaConfig
from levanter.optim import AdamConfig
from levanter.utils.jax_utils import leaf_key_paths

from qkvflow.models import registry
from qkvflow.training.adam import decayed_parameter_count, with_decay_mask

# The weight matrices of one layer, written out here from the block designs (not read from the code):
# GPT-2's c_attn split into Q, K, V, its c_proj O, its MLP's c_fc W1 and c_proj W2; Llama's
# Q, K, V, O and SwiGLU's gate, up and down projections.
MATRICES = {
    "gpt2": {"q", "k", "v", "o", "w1", "w2"},
    "llama": {"q", "k", "v", "o", "w_gate", "w_up", "w_down"},
}
SIZE = dict(hidden_dim=8, num_heads=2, max_seq_len=16, time_embed_dim=4, num_frequencies=4)
VOCAB = hax.Axis("vocab", 32)


def ode_configs():
    """Every ODE family, plus the variants that change which parameters exist."""
    cases = []
    for family in registry.families():
        if not family.ode or family.config_class.__module__.startswith("tests."):
            continue
        config = family.config_class(**SIZE)
        cases.append(pytest.param(config, id=family.name))
        cases.append(
            pytest.param(
                dataclasses.replace(config, tie_word_embeddings=not config.tied_embeddings),
                id=f"{family.name}-tying-flipped",
            )
        )
        if config.generator == "hyper":
            variant = dataclasses.replace(config, shared_time_mlp=True, time_embed_norm=True)
            cases.append(pytest.param(variant, id=f"{family.name}-shared_time_mlp"))
    return cases


def paths_and_flags(config, optimizer):
    model = eqx.filter_eval_shape(config.build, VOCAB, key=jax.random.PRNGKey(0))
    model = eqx.filter(model, lambda x: isinstance(x, jax.ShapeDtypeStruct))  # parameters only
    is_leaf = lambda x: hax.is_named_array(x) or isinstance(x, jax.ShapeDtypeStruct)  # noqa: E731
    paths = jax.tree_util.tree_leaves(leaf_key_paths(model, is_leaf=is_leaf), is_leaf=lambda x: isinstance(x, str))
    flags = jax.tree_util.tree_leaves(optimizer.build_weight_decay_mask()(model), is_leaf=lambda x: isinstance(x, bool))
    sizes = [x.size for x in jax.tree_util.tree_leaves(model, is_leaf=is_leaf)]
    assert len(paths) == len(flags) == len(sizes)
    return model, dict(zip(paths, flags)), dict(zip(paths, sizes))


def should_decay(path: str, config) -> bool:
    """GPT-2's rule restated for generators: a matrix's projection and its own time MLP's weights
    (hypernetwork), the constant matrix (weight-shared), and an untied output head."""
    parts = path.split(".")
    matrices = MATRICES[config.flavour]
    if path == "lm_head":
        return True
    if parts[:2] == ["generator", "constants"]:
        return len(parts) == 3 and parts[2] in matrices
    if parts[:2] == ["generator", "projections"]:  # a stack of projections, its members joined by "+"
        return len(parts) == 3 and set(parts[2].split("+")) <= matrices
    if parts[:3] == ["generator", "mlps", "matrix"]:  # the stack of the matrices' own time MLPs
        return parts[-1] == "weight"
    return False


@pytest.mark.parametrize("config", ode_configs())
def test_ode_models_decay_exactly_the_generators_of_matrices(config):
    optimizer = with_decay_mask(AdamConfig(weight_decay=0.1), config)
    model, flags, sizes = paths_and_flags(config, optimizer)
    wrong = {p: f for p, f in flags.items() if f != should_decay(p, config)}
    assert not wrong, wrong
    # what the mask spares is really there (the test is not vacuous) ...
    spared = [p for p in flags if "norm" in p or p.endswith("bias") or "time_bias" in p or "shared_mlp" in p]
    assert spared and not any(flags[p] for p in spared)
    stacks = [p for p in flags if p.startswith("generator.projections.")]
    if stacks:  # stacked hypernetworks: the decayed stacks hold every matrix and nothing else
        assert {n for p in stacks if flags[p] for n in p.split(".")[2].split("+")} == MATRICES[config.flavour]
    else:
        assert sum(flags.values()) >= len(MATRICES[config.flavour])
    # ... and the run's reported count is the size of what decays
    params = jax.tree_util.tree_map(lambda s: jax.numpy.zeros(s.shape, s.dtype), model)
    assert decayed_parameter_count(optimizer, params) == sum(sizes[p] for p, f in flags.items() if f)


def test_the_shared_model_no_longer_decays_its_norm_scales():
    """The bug this module fixes: Levanter's name-based default decays `generator.constants.attn_norm`."""
    config = registry.family("shared_ode_gpt2").config_class(**SIZE)
    _, levanter_default, _ = paths_and_flags(config, AdamConfig(weight_decay=0.1))
    _, ours, _ = paths_and_flags(config, with_decay_mask(AdamConfig(weight_decay=0.1), config))
    for name in ("generator.constants.attn_norm", "generator.constants.mlp_norm", "generator.time_bias.q"):
        assert levanter_default[name] and not ours[name]


@pytest.mark.parametrize(
    "config",
    [
        pytest.param(
            registry.family("parallel_gpt2").config_class(hidden_dim=8, num_heads=2, num_layers=2, max_seq_len=16),
            id="parallel_gpt2",
        ),
        pytest.param(
            registry.family("parallel_llama").config_class(hidden_dim=8, num_heads=2, num_layers=2, max_seq_len=16),
            id="parallel_llama",
        ),
        pytest.param(Gpt2Config(hidden_dim=8, num_heads=2, num_layers=2, max_seq_len=16), id="gpt2"),
        pytest.param(
            LlamaConfig(hidden_dim=8, intermediate_dim=16, num_heads=2, num_kv_heads=2, num_layers=2, max_seq_len=16),
            id="llama",
        ),
    ],
)
def test_discrete_models_keep_levanters_default(config):
    """GPT-2 and Llama (and their parallel forms) decay their projection weights and an untied head only."""
    default = AdamConfig(weight_decay=0.1)
    assert with_decay_mask(default, config) is default
    _, flags, _ = paths_and_flags(config, default)
    decayed = {p for p, f in flags.items() if f}
    assert decayed and all(
        p.endswith(".weight") and "norm" not in p and "embed" not in p and "wpe" not in p for p in decayed
    ), decayed


@pytest.mark.parametrize(
    "choice",
    [dict(weight_decay_modules="lm_head"), dict(default_weight_decay_mask=True), dict(default_weight_decay_mask=False)],
)
def test_a_mask_the_config_chose_is_kept(choice):
    config = registry.family("diffeqformer_gpt2").config_class(**SIZE)
    optimizer = AdamConfig(weight_decay=0.1, **choice)
    assert with_decay_mask(optimizer, config) is optimizer


def test_no_decay_counts_nothing():
    config = registry.family("diffeqformer_gpt2").config_class(**SIZE)
    optimizer = with_decay_mask(AdamConfig(weight_decay=0.0), config)
    model = config.build(VOCAB, key=jax.random.PRNGKey(0))
    assert decayed_parameter_count(optimizer, model) == 0


def test_the_optimizer_that_trains_decays_exactly_the_mask(monkeypatch):
    """`train_run` hands Levanter's Trainer the masked optimizer, not `config.optimizer` (whose Levanter
    default decays the norms' generators): caught as the Trainer receives it, one update with zero
    gradients, where only weight decay moves anything (Adam's step is 0/(0 + eps) = 0), shrinks each
    parameter `should_decay` names by decoupled decay, p <- p - lr * wd * p, and leaves the rest exactly."""
    import jax.numpy as jnp

    from qkvflow.runs.config import TrainConfig
    from qkvflow.training import loop
    from tests.analysis.builders import filled
    from tests.helpers import parse_config
    from tests.train_utils import TINY

    class Caught(Exception):
        pass

    def trainer(config, optimizer, loss_fn, **kwargs):
        raise Caught(optimizer)

    config = parse_config(TINY, TrainConfig)
    lr, wd = config.optimizer.learning_rate, config.optimizer.weight_decay
    assert (lr, wd, config.optimizer.warmup) == (1e-2, 0.1, 0.0)  # tiny_train.yaml: step 0 runs at lr
    monkeypatch.setattr(loop, "Trainer", trainer)
    with pytest.raises(Caught) as caught:
        loop.train_run(loop.Run(config=config, verb="train", Pos=config.model.max_Pos), None, None, None, {})
    optimizer = caught.value.args[0]

    params = eqx.filter(filled(config.model, VOCAB, std=1.0), eqx.is_array)  # random weights, no compile

    @eqx.filter_jit
    def step(params):
        zeros = jax.tree_util.tree_map(jnp.zeros_like, params)
        updates, _ = optimizer.update(zeros, optimizer.init(params), params)
        return eqx.apply_updates(params, updates)

    after = step(params)
    is_leaf = hax.is_named_array
    paths = jax.tree_util.tree_leaves(leaf_key_paths(params, is_leaf=is_leaf), is_leaf=lambda x: isinstance(x, str))
    before_leaves = jax.tree_util.tree_leaves(params, is_leaf=is_leaf)
    after_leaves = jax.tree_util.tree_leaves(after, is_leaf=is_leaf)
    decayed = 0
    for path, old, new in zip(paths, before_leaves, after_leaves, strict=True):
        old, new = np.asarray(getattr(old, "array", old)), np.asarray(getattr(new, "array", new))
        if should_decay(path, config.model):
            decayed += 1
            np.testing.assert_allclose(new, old * (1 - lr * wd), rtol=4 * np.finfo(np.float32).eps, err_msg=path)
        else:
            np.testing.assert_array_equal(new, old, err_msg=path)
    assert decayed >= 6 and len(paths) > 2 * decayed  # both kinds are there (4 stacks of projections, 2 MLP weights)
