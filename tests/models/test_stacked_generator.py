"""The stacked hypernetworks (`HyperGenerator`) against the per-weight layout they replace.

Reference: each weight's W(t) = offset + Proj(silu(MLP(Sinusoidal(t)))) / d_emb written out here from
the per-weight parameters (`qkvflow.nn.time_dependent`'s equation), weight by weight, in numpy float64.
"""

import haliax as hax
import jax
import jax.numpy as jnp
import jax.random as jrandom
import numpy as np
import pytest

from qkvflow.models.generator import STACK, HyperGenerator, stack_groups
from qkvflow.models.per_weight import PerWeightGenerator
from tests.helpers import tiny_config

CASES = {
    "gpt2": dict(flavour="gpt2"),
    "llama": dict(flavour="llama"),
    "gpt2_shared_mlp": dict(flavour="gpt2", shared_time_mlp=True),
    "gpt2_norm": dict(flavour="gpt2", time_embed_norm=True),
}


def _specs_and_config(case):
    kwargs = dict(CASES[case])
    config = tiny_config(kwargs.pop("flavour"), **kwargs)
    return config.flavour_spec.field.weight_specs(config), config


def _silu(x):
    return x / (1 + np.exp(-x))


def _reference(per_weight: PerWeightGenerator, name: str, t: float, normalise: bool) -> np.ndarray:
    """W_name(t) from the per-weight parameters, in float64."""
    s = np.asarray(per_weight.time_embedding(jnp.float32(t)).array, np.float64)
    w = per_weight.weights[name]
    mlp = per_weight.shared_mlp if w.mlp is None else w.mlp

    def linear(layer, x):
        weight = layer.weight.rearrange((layer.Out, layer.In)).array
        return np.asarray(weight, np.float64) @ x + np.asarray(layer.bias.array, np.float64)

    e = _silu(linear(mlp.lin2, _silu(linear(mlp.lin1, s))))
    if normalise:
        e = e / np.sqrt(np.mean(e**2) + 1e-6)
    proj = np.asarray(w.proj.array, np.float64)
    return w.offset + np.tensordot(e / e.size, proj, axes=1)


@pytest.mark.parametrize("case", sorted(CASES))
def test_init_is_the_per_weight_init_stacked_bit_for_bit(case):
    specs, config = _specs_and_config(case)
    key = jrandom.PRNGKey(3)
    stacked = HyperGenerator.init(specs, config, key=key)
    per_weight = PerWeightGenerator.init(specs, config, key=key)
    for name in specs:
        ours, theirs = stacked.weights[name], per_weight.weights[name]
        for a, b in zip(jax.tree_util.tree_leaves(ours), jax.tree_util.tree_leaves(theirs), strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        assert ours.offset == theirs.offset and ours.normalise == theirs.normalise
    # a round trip through the per-weight layout gives back the same stacks
    back = HyperGenerator.from_per_weight(stacked.per_weight(), specs)
    for a, b in zip(jax.tree_util.tree_leaves(back), jax.tree_util.tree_leaves(stacked), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("case", sorted(CASES))
def test_stacked_weights_equal_the_per_weight_equation(case):
    specs, config = _specs_and_config(case)
    per_weight = PerWeightGenerator.init(specs, config, key=jrandom.PRNGKey(4))
    # train-like parameters: random biases too (init leaves them at 0), so that every term shows
    leaves, treedef = jax.tree_util.tree_flatten(per_weight)
    keys = jrandom.split(jrandom.PRNGKey(5), len(leaves))
    leaves = [x + 0.1 * jrandom.normal(k, x.shape) if x.dtype == jnp.float32 else x for x, k in zip(leaves, keys)]
    per_weight = jax.tree_util.tree_unflatten(treedef, leaves)
    stacked = HyperGenerator.from_per_weight(per_weight, specs)
    times = np.array([0.0, 0.25, 0.6, 1.0], np.float32)
    table = stacked.at_times(hax.named(jnp.asarray(times), "ode_time"))
    for k, t in enumerate(times):
        at_t = stacked(jnp.float32(t))
        for name, spec in specs.items():
            want = _reference(per_weight, name, float(t), config.time_embed_norm)
            got_table = table[name]["ode_time", k]
            assert got_table.axes == at_t[name].axes == spec.axes, name
            # float32 round-off of a d_emb-term dot product of O(1) terms on top of an O(1e-2) result
            tol = 1e-5 * (1 + np.abs(want))
            np.testing.assert_array_less(np.abs(np.asarray(at_t[name].array) - want), tol)
            np.testing.assert_array_less(np.abs(np.asarray(got_table.array) - want), tol)
    assert list(table) == list(specs)


def test_groups_stack_same_shaped_weights_and_keep_kinds_apart():
    specs, _ = _specs_and_config("gpt2")
    groups = {g.key: (g.kind, g.mlp) for g in stack_groups(specs)}
    assert groups["q+k+v"] == ("matrix", "matrix")
    assert groups["attn_norm+mlp_norm"] == ("norm", "vector")  # scales: offset 1, so not with the biases
    assert groups["attn_norm_bias+o_bias+mlp_norm_bias+w2_bias"] == ("bias", "vector")
    assert sorted(n for g in stack_groups(specs) for n in g.names) == sorted(specs)
    specs_llama, config = _specs_and_config("llama")
    generator = HyperGenerator.init(specs_llama, config, key=jrandom.PRNGKey(0))
    assert generator.projections["w_gate+w_up"].axes[0] == hax.Axis(STACK, 2)
    assert generator.mlps["matrix"].lin1.weight.axes[0] == hax.Axis(STACK, 7)  # q k v o, gate up down
    assert generator.mlps["vector"].lin1.weight.axes[0] == hax.Axis(STACK, 2)  # the two RMSNorm scales
