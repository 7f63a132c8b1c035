"""The N-ODE Transformer against references written here from the paper's equations (numpy loops)."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qkvflow.data.parity import PAD, SOS, parity_dataset
from qkvflow.errors import UserError
from qkvflow.integrate.solve import integrate
from qkvflow.models.related.node_transformer import NodeTransformerConfig, field, forward, init, masks, real_rows_rms

D = 8


def np_affine(p, x, t):
    """Eq. 5: x A + b + c t (c only where the model is time-dependent)."""
    y = np.asarray(x) @ np.asarray(p["A"]) + np.asarray(p["b"])
    return y + np.asarray(p["c"]) * t if "c" in p else y


def np_field(block, x, t, n_real, alpha, causal=False):
    """X' = FFN_t(alpha X + MHSA_t(X)), d/2 heads of size 2, loops over heads and queries."""
    x = np.asarray(x, np.float64)
    n = x.shape[0]
    q, k, v = (np_affine(block[name], x, t) for name in "qkv")
    att = np.zeros_like(x)
    for h in range(D // 2):
        sl = slice(2 * h, 2 * h + 2)
        for i in range(n):
            keys = [j for j in range(n_real) if (j <= i or not causal)]
            s = np.array([q[i, sl] @ k[j, sl] / math.sqrt(2.0) for j in keys])
            w = np.exp(s - s.max()) / np.exp(s - s.max()).sum()
            att[i, sl] = sum(wj * v[j, sl] for wj, j in zip(w, keys))
    z = alpha * x + np_affine(block["o"], att, t)
    dx = np_affine(block["ff2"], np.maximum(np_affine(block["ff1"], z, t), 0.0), t)
    dx[n_real:] = 0.0
    return dx


@pytest.fixture(scope="module")
def setup():
    config = NodeTransformerConfig(max_len=8)
    params = init(config, jax.random.PRNGKey(0))
    # random nonzero biases and time coefficients, so that b and c t are exercised
    leaves, tree = jax.tree_util.tree_flatten(params)
    keys = jax.random.split(jax.random.PRNGKey(1), len(leaves))
    params = jax.tree_util.tree_unflatten(
        tree, [leaf + 0.3 * jax.random.normal(key, leaf.shape) for leaf, key in zip(leaves, keys)]
    )
    return config, params


@pytest.mark.parametrize("alpha", [0, 1])
@pytest.mark.parametrize("time_attention", [False, True])
def test_field_matches_equations(setup, alpha, time_attention):
    config = NodeTransformerConfig(max_len=8, alpha=alpha, time_attention=time_attention)
    params = init(config, jax.random.PRNGKey(2))
    block = jax.tree_util.tree_map(lambda a: a + 0.3 * jax.random.normal(jax.random.PRNGKey(3), a.shape), params)[
        "blocks"
    ][0]
    assert ("c" in block["q"]) == time_attention and "c" in block["ff1"]
    tokens = jnp.array([SOS, 1, 0, 1, PAD, PAD])
    x = jax.random.normal(jax.random.PRNGKey(4), (6, D))
    mask, row_mask = masks(tokens, config)
    t = 0.37
    got = field(t, x, block, mask, row_mask, config)
    want = np_field(block, x, t, 4, alpha)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)


def test_causal_field_matches_equations(setup):
    config = NodeTransformerConfig(max_len=8, causal=True)
    _, params = setup
    block = params["blocks"][1]
    tokens = jnp.array([SOS, 0, 1, 3, PAD])
    x = jax.random.normal(jax.random.PRNGKey(5), (5, D))
    mask, row_mask = masks(tokens, config)
    got = field(0.8, x, block, mask, row_mask, config)
    np.testing.assert_allclose(np.asarray(got), np_field(block, x, 0.8, 4, 1, causal=True), rtol=1e-5, atol=1e-5)


def rk4_reference(block, x, n_real, steps=100):
    """Classical RK4 on a fine grid: X(1) and int_0^1 ||X'||_F^2 dt (Simpson on the stages)."""
    x, h, energy = np.asarray(x, np.float64), 1.0 / steps, 0.0
    for i in range(steps):
        t = i * h
        k1 = np_field(block, x, t, n_real, 1)
        k2 = np_field(block, x + h / 2 * k1, t + h / 2, n_real, 1)
        k3 = np_field(block, x + h / 2 * k2, t + h / 2, n_real, 1)
        k4 = np_field(block, x + h * k3, t + h, n_real, 1)
        energy += h / 6 * ((k1**2).sum() + 2 * (k2**2).sum() + 2 * (k3**2).sum() + (k4**2).sum())
        x = x + h / 6 * (k1 + 2 * k2 + 2 * k3 + k4)
    return x, energy


def test_forward_readout_and_regulariser(setup):
    """Two chained blocks, SOS readout through relu MLP, R = lambda / (2L) sum_blocks int ||X'||^2, with L
    the string's own length (SOS included), not the padded width."""
    lam = 0.25
    config = NodeTransformerConfig(max_len=8, kinetic_lambda=lam)
    _, params = setup
    data = parity_dataset(2)
    tokens, lengths = data.tokens[[1, 3, 4]], data.lengths[[1, 3, 4]]  # "1" (padded), "01", "10"
    assert list(lengths) == [2, 3, 3] and tokens.shape[1] == 3 and tokens[0, 2] == PAD
    logits, reg, nfe = forward(params, jnp.asarray(tokens), jnp.asarray(lengths), config)
    assert nfe.shape == (3,) and (nfe > 0).all()
    for b in range(3):
        n = int(lengths[b])
        x = np.asarray(params["embed"])[tokens[b]] + pos_encoding(tokens.shape[1])
        total = 0.0
        for block in params["blocks"]:
            x, e = rk4_reference(block, x, n)
            total += e
        hidden = np.maximum(np_affine(params["head1"], x[0], 0.0), 0.0)
        want_logits = np_affine(params["head2"], hidden, 0.0)
        # adaptive tsit5 at rtol = atol = 1e-5 against a fine RK4: tolerance-level agreement
        np.testing.assert_allclose(np.asarray(logits[b]), want_logits, rtol=1e-3, atol=1e-3)
        np.testing.assert_allclose(float(reg[b]), lam / (2 * n) * total, rtol=1e-3)


def pos_encoding(n):
    """Sinusoidal positions, PE[p, 2i] = sin(p / 10000^(2i/d)), PE[p, 2i+1] = cos(...)."""
    pe = np.zeros((n, D))
    for p in range(n):
        for i in range(0, D, 2):
            pe[p, i] = math.sin(p / 10000 ** (i / D))
            pe[p, i + 1] = math.cos(p / 10000 ** (i / D))
    return pe


def test_defaults_are_the_papers():
    c = NodeTransformerConfig()
    assert (c.hidden_dim, c.num_blocks, c.alpha, c.rtol, c.atol) == (8, 2, 1, 1e-5, 1e-5)
    assert c.num_heads == 4 and c.solver == "tsit5" and not c.time_attention and c.ode


@pytest.mark.parametrize(
    "key,value",
    [("hidden_dim", 7), ("num_blocks", 0), ("alpha", 2), ("solver", "euler"), ("rtol", 0.0), ("kinetic_lambda", -1.0)],
)
def test_bad_config_names_key(key, value):
    with pytest.raises(UserError, match=f"model.{key}") as err:
        NodeTransformerConfig(**{key: value})
    assert "\n" not in str(err.value)


def test_causal_field_is_causal(setup):
    """Causal-LM adaptation: a later state never moves an earlier one's derivative."""
    config = NodeTransformerConfig(max_len=8, causal=True)
    block = setup[1]["blocks"][0]
    tokens = jnp.array([SOS, 0, 1, 1, 3])
    x = jax.random.normal(jax.random.PRNGKey(6), (5, D))
    mask, row_mask = masks(tokens, config)
    base = field(0.5, x, block, mask, row_mask, config)
    moved = field(0.5, x.at[3].add(1.0), block, mask, row_mask, config)
    np.testing.assert_array_equal(np.asarray(base[:3]), np.asarray(moved[:3]))
    assert not np.allclose(np.asarray(base[3:]), np.asarray(moved[3:]))


def test_parity_benchmark_writes_outputs(tmp_path):
    """The reproduction command runs end to end (vanilla, 2 steps, length <= 2) and writes JSON, table, plot."""
    import importlib.util
    import json
    import pathlib

    path = pathlib.Path(__file__).parents[2] / "benchmarks" / "node_parity.py"
    spec = importlib.util.spec_from_file_location("node_parity", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    argv = ["--max-length", "2", "--models", "vanilla", "--lrs", "1e-2", "--seeds", "0", "--steps", "2"]
    assert bench.main([*argv, "--out", str(tmp_path)]) == 0
    (result,) = json.loads((tmp_path / "results_L2.json").read_text())
    assert result["model"] == "vanilla" and 0.0 <= result["best_train_acc"] <= 1.0
    assert (tmp_path / "table_L2.md").exists() and (tmp_path / "nfe_L2.png").exists()
    row = bench.summarise(bench.load([tmp_path / "results_L2.json"])).splitlines()[-1]
    acc = f"{100 * result['best_train_acc']:.1f}"
    assert row.startswith(f"| <= 2 | vanilla | 0.01 | 2 | 1 | {acc} (-) [{acc}, {acc}]")


def test_masked_error_norm_is_the_unpadded_rms():
    """real_rows_rms of a padded error = the plain RMS of the unpadded error (rows and the energy leaf)."""
    rng = np.random.default_rng(0)
    err, energy = rng.normal(size=(3, D)).astype(np.float32), np.float32(0.7)
    padded = np.concatenate([err, rng.normal(size=(4, D)).astype(np.float32)])  # PAD rows' values must not count
    row_mask = jnp.asarray([1.0, 1, 1, 0, 0, 0, 0])
    want = math.sqrt((np.sum(err.astype(np.float64) ** 2) + energy**2) / (3 * D + 1))
    got = real_rows_rms(row_mask)((jnp.asarray(padded), jnp.asarray(energy)))
    np.testing.assert_allclose(float(got), want, rtol=1e-6)
    assert float(real_rows_rms(row_mask)((jnp.zeros((7, D)), jnp.zeros(())))) == 0.0


def test_padding_changes_no_step():
    """A solve padded with zero-field rows takes exactly the steps of the unpadded solve once the controller
    uses real_rows_rms; diffrax's default RMS (over the PAD rows too) takes a different number here.
    A row-wise field keeps the real rows' arithmetic identical, so any difference is the error norm's."""
    cfg = NodeTransformerConfig().ode_config
    w = jax.random.normal(jax.random.PRNGKey(0), (D,)) * 3.0

    def f(t, y, row_mask):
        return jnp.sin(y * w + 4.0 * t) * row_mask[:, None]

    pad = 9
    y0 = jax.random.normal(jax.random.PRNGKey(1), (3, D))
    y1, e1, s1 = integrate(f, y0, jnp.ones(3), cfg, tokens=1)
    row_mask = jnp.concatenate([jnp.ones(3), jnp.zeros(pad)])
    y_pad = jnp.concatenate([y0, jnp.zeros((pad, D))])
    y2, e2, s2 = integrate(f, y_pad, row_mask, cfg, tokens=1, norm=real_rows_rms(row_mask))
    assert int(s2.nfe) == int(s1.nfe) and int(s2.num_steps) == int(s1.num_steps)
    np.testing.assert_array_equal(np.asarray(y2[:3]), np.asarray(y1))
    _, _, s3 = integrate(f, y_pad, row_mask, cfg, tokens=1)  # the bias the masked norm removes
    assert int(s3.nfe) != int(s1.nfe)
