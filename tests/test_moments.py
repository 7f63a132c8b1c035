"""`hypernetwork_mu_dtype`: Adam's first moment of the hypernetwork projections stored in bfloat16.

Reference (optax's `mu_dtype` rule, written out here): with g_k the clipped gradient,
    m_k = b1 * m_{k-1} + (1 - b1) * g_k   in float32, from the stored m_{k-1} widened exactly,
    stored: bfloat16(m_k) on the projections, m_k elsewhere; nu always float32, as plain Adam's.
"""

import jax
import jax.numpy as jnp
import jax.random as jrandom
import numpy as np
import optax
import pytest
from levanter.optim import AdamConfig

from qkvflow.errors import UserError
from qkvflow.training.adam import with_hypernetwork_mu_dtype
from tests.helpers import tiny_config, tiny_model


def _adam_states(state):
    return [
        s
        for s in jax.tree_util.tree_leaves(state, is_leaf=lambda x: isinstance(x, optax.ScaleByAdamState))
        if isinstance(s, optax.ScaleByAdamState)
    ]


def _leaves(tree):
    return jax.tree_util.tree_leaves_with_path(tree)


def test_mu_of_exactly_the_projections_is_bfloat16_and_follows_optax_rule():
    import equinox as eqx

    params = eqx.filter(tiny_model(tiny_config()), eqx.is_inexact_array)
    adam = AdamConfig(learning_rate=1e-3, warmup=0.0, max_grad_norm=None, beta1=0.9)
    plain, narrow = adam.build(10), with_hypernetwork_mu_dtype(adam.build(10), "bfloat16")
    state_plain, state_narrow = plain.init(params), narrow.init(params)

    (adam_narrow,) = _adam_states(state_narrow)
    for path, m in _leaves(adam_narrow.mu):
        name = jax.tree_util.keystr(path)
        want = jnp.bfloat16 if ".generator.projections[" in name else jnp.float32
        assert m.dtype == want, name
    assert {m.dtype for m in jax.tree_util.tree_leaves(adam_narrow.nu)} == {jnp.dtype(jnp.float32)}
    assert any(".generator.projections[" in jax.tree_util.keystr(p) for p, _ in _leaves(adam_narrow.mu))
    assert any(".generator.mlps[" in jax.tree_util.keystr(p) for p, _ in _leaves(adam_narrow.mu))  # stays f32

    leaves, treedef = jax.tree_util.tree_flatten(params)
    m_ref = [np.zeros(x.shape, np.float32) for x in leaves]
    for k in range(3):
        keys = jrandom.split(jrandom.PRNGKey(k), len(leaves))
        grads = jax.tree_util.tree_unflatten(treedef, [jrandom.normal(key, x.shape) for key, x in zip(keys, leaves)])
        _, state_plain = plain.update(grads, state_plain, params)
        _, state_narrow = narrow.update(grads, state_narrow, params)
        paths = [jax.tree_util.keystr(p) for p, _ in _leaves(grads)]
        for i, (name, g) in enumerate(zip(paths, jax.tree_util.tree_leaves(grads))):
            m = 0.9 * m_ref[i] + np.float32(0.1) * np.asarray(g, np.float32)
            m_ref[i] = (
                np.asarray(jnp.asarray(m).astype(jnp.bfloat16).astype(jnp.float32)) if "projections[" in name else m
            )
    (adam_plain,) = _adam_states(state_plain)
    (adam_narrow,) = _adam_states(state_narrow)
    narrowed = 0
    for (path, mu), mu_plain, want in zip(_leaves(adam_narrow.mu), jax.tree_util.tree_leaves(adam_plain.mu), m_ref):
        name = jax.tree_util.keystr(path)
        got = np.asarray(mu.astype(jnp.float32))
        if "projections[" in name:
            narrowed += 1
            # one bfloat16 rounding of the same float32 sum: equal up to float32 round-off of that sum
            np.testing.assert_allclose(got, want, rtol=2**-8, atol=0, err_msg=name)
            assert not np.array_equal(got, np.asarray(mu_plain)), name  # it really is narrower
        else:
            np.testing.assert_array_equal(got, np.asarray(mu_plain), err_msg=name)  # untouched: plain Adam's
            np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7, err_msg=name)
    assert narrowed == 8  # gpt2: the eight stacks of projections
    for a, b in zip(jax.tree_util.tree_leaves(adam_narrow.nu), jax.tree_util.tree_leaves(adam_plain.nu)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_bfloat16_for_new_runs_by_default_and_bad_values_get_one_line():
    from qkvflow.runs.config import TrainConfig
    from qkvflow.training.adam import resolve

    assert TrainConfig().hypernetwork_mu_dtype == "auto"
    assert resolve("auto") == jnp.bfloat16 and resolve(None) == jnp.float32 and resolve("float32") == jnp.float32
    optimizer = AdamConfig().build(10)
    assert with_hypernetwork_mu_dtype(optimizer, None) is optimizer
    assert with_hypernetwork_mu_dtype(optimizer, "float32") is optimizer
    with pytest.raises(UserError) as error:
        with_hypernetwork_mu_dtype(optimizer, "bf16")
    assert str(error.value) == (
        "hypernetwork_mu_dtype='bf16' is invalid: expected auto, null or one of ['bfloat16', 'float32']"
    )


def _checkpoint(folder, mu_dtypes: dict) -> str:
    """A checkpoint folder in Levanter 1.2's layout (a zarr v2 `.zarray` per array), metadata only."""
    import json

    for key, dtype in {"model/generator/projections/w1": "<f4", **mu_dtypes}.items():
        (folder / key).mkdir(parents=True)
        (folder / key / ".zarray").write_text(json.dumps({"shape": [8, 4], "dtype": dtype}))
    return str(folder)


@pytest.mark.parametrize(
    "stored, value, want",
    [
        ("<f4", "auto", "float32"),  # a run begun with float32 moments goes on in float32
        ("bfloat16", "auto", "bfloat16"),
        ("<f4", "float32", "float32"),
        ("<f4", None, None),
        ("bfloat16", "bfloat16", "bfloat16"),
    ],
)
def test_a_resumed_run_keeps_the_dtype_its_checkpoint_stores(tmp_path, stored, value, want):
    from qkvflow.training.adam import for_resume

    mu = {f"opt_state/inner/inner_state/1/mu/generator/projections/{n}": stored for n in ("w1", "q+k+v")}
    mu["opt_state/inner/inner_state/1/mu/token_embeddings/weight"] = "<f4"  # not a projection: never read
    mu["opt_state/inner/inner_state/1/nu/generator/projections/w1"] = "<f4"
    assert for_resume(value, _checkpoint(tmp_path, mu)) == want
    assert for_resume(value, None) == value  # a new run


def test_resuming_with_another_dtype_than_stored_is_refused_in_one_line(tmp_path):
    from qkvflow.training.adam import for_resume

    path = _checkpoint(tmp_path, {"opt_state/inner/inner_state/1/mu/generator/projections/w1": "bfloat16"})
    with pytest.raises(UserError) as error:
        for_resume("float32", path)
    assert str(error.value) == (
        f"hypernetwork_mu_dtype='float32' but checkpoint {path!r} stores the first moments in bfloat16: resume "
        "with hypernetwork_mu_dtype: auto (or bfloat16), or start a new run (a new trainer.id)"
    )
    # a checkpoint with no hypernetwork moments (a GPT-2's) decides nothing
    assert for_resume("float32", _checkpoint(tmp_path / "gpt2", {"opt_state/mu/blocks/w": "bfloat16"})) == "float32"


def test_bench_speed_times_the_optimizer_state_a_new_run_has():
    """`qkvflow bench speed` steps with the first moments `qkvflow train` stores by default (bfloat16 on the
    projections), and with float32 ones when asked (the kernel counts made before the switch)."""
    import equinox as eqx

    from qkvflow.bench.performance.step import bench_optimizer

    params = eqx.filter(tiny_model(tiny_config()), eqx.is_inexact_array)
    for mu_dtype, want in [("auto", jnp.bfloat16), ("float32", jnp.float32)]:
        (adam,) = _adam_states(bench_optimizer(mu_dtype).init(params))
        stored = {jax.tree_util.keystr(p): m.dtype for p, m in _leaves(adam.mu)}
        assert {d for name, d in stored.items() if ".generator.projections[" in name} == {jnp.dtype(want)}
        assert {d for name, d in stored.items() if ".generator.projections[" not in name} == {jnp.dtype(jnp.float32)}


def test_a_checkpoint_with_projection_moments_of_several_dtypes_is_refused_in_one_line(tmp_path):
    """qkvflow stores every projection's first moment in one dtype; a checkpoint holding two decides no
    dtype, whatever is asked for: refused, naming the checkpoint and both dtypes, not resumed in either."""
    from qkvflow.training.adam import for_resume

    mu = "opt_state/inner/inner_state/1/mu/generator/projections"
    path = _checkpoint(tmp_path, {f"{mu}/w1": "bfloat16", f"{mu}/w2": "<f4"})
    for value in ("auto", "bfloat16", "float32", None):
        with pytest.raises(UserError) as error:
            for_resume(value, path)
        assert str(error.value) == (
            f"checkpoint {path!r} holds the hypernetwork projections' first moments in several dtypes "
            "['bfloat16', 'float32'], where qkvflow stores one: no hypernetwork_mu_dtype follows from it; start a "
            "new run (a new trainer.id) or resume from a checkpoint qkvflow wrote"
        )


@pytest.mark.parametrize("stored", ["bfloat16", "float32"])
def test_the_stored_dtype_is_read_from_the_zarr_v3_arrays_levanter_writes(tmp_path, stored):
    """Levanter (marin) writes a checkpoint as one OCDBT store of zarr v3 arrays, whose metadata names the
    dtype `data_type` (zarr v2's key was `dtype`). Arrays written here by tensorstore, as Levanter writes
    them, metadata and all: the dtype is read from `data_type`."""
    import tensorstore as ts
    from levanter.tensorstore_serialization import build_kvstore_spec

    from qkvflow.runs.checkpoint_arrays import array_dtypes, is_ocdbt
    from qkvflow.training.adam import for_resume

    arrays = {
        "model/generator/projections/w1": ts.float32,
        "opt_state/inner/inner_state/1/mu/generator/projections/w1": getattr(ts, stored),
        "opt_state/inner/inner_state/1/nu/generator/projections/w1": ts.float32,
    }
    for key, dtype in arrays.items():
        store = {"driver": "ocdbt", "base": build_kvstore_spec(str(tmp_path)), "path": key + "/"}
        ts.open({"driver": "zarr3", "kvstore": store}, create=True, dtype=dtype, shape=[8, 4]).result()
    assert is_ocdbt(str(tmp_path))
    assert array_dtypes(str(tmp_path)) == {key: dtype.name for key, dtype in arrays.items()}
    assert for_resume("auto", str(tmp_path)) == stored
