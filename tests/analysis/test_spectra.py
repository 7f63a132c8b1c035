"""Spectra of hand-built circuits come out exactly, for ODE models and Levanter's layer stacks."""

import equinox as eqx
import haliax as hax
import jax.numpy as jnp
import numpy as np
import pytest

from qkvflow.analysis.circuits import circuits_of
from qkvflow.analysis.spectra import analyze_spectra, ov_spectrum, qk_spectrum, relative_variation, sorted_real
from qkvflow.integrate.config import OdeConfig
from qkvflow.models.diffeqformer import SharedOdeGpt2Config
from tests.analysis.builders import filled

E, D = 6, 3  # hidden 6, two heads of size 3
Q0 = np.vstack([np.eye(D), np.zeros((D, D))])  # embed x head_size
K0 = np.vstack([np.diag([1.0, 2.0, 3.0]), np.zeros((D, D))])  # K0^T Q0 = diag(1, 2, 3)
V0 = np.vstack([np.zeros((D, D)), np.eye(D)])
O0 = np.hstack([np.zeros((D, D)), np.diag([-1.0, 0.5, 2.0])])  # head_size x embed; O0 V0 = diag(-1, .5, 2)


def _set_head(w, head: int, block: np.ndarray, head_axis: int):
    """w's array with head `head` (axis `head_axis`) replaced by `block`."""
    index = [slice(None)] * w.array.ndim
    index[head_axis] = head
    return hax.named(w.array.at[tuple(index)].set(jnp.asarray(block, w.array.dtype)), w.axes)


def test_hand_built_shared_weights_give_exact_constant_spectra(tmp_path):
    model = filled(SharedOdeGpt2Config(max_seq_len=8, hidden_dim=E, num_heads=2, ode=OdeConfig(3)))
    c = dict(model.generator.constants)  # q, k, v: [embed, heads, head_size]; o: [heads, head_size, embed]
    c["q"], c["k"], c["v"] = (_set_head(c[n], 0, m, 1) for n, m in (("q", Q0), ("k", K0), ("v", V0)))
    c["o"] = _set_head(c["o"], 0, O0, 0)
    model = eqx.tree_at(lambda m: m.generator.constants, model, c)

    circuits = circuits_of(model, num_times=5)
    qk, ov = sorted_real(qk_spectrum(circuits)), sorted_real(ov_spectrum(circuits))
    np.testing.assert_allclose(qk[:, 0], np.tile([3.0, 2.0, 1.0], (5, 1)), atol=1e-6)
    np.testing.assert_allclose(ov[:, 0], np.tile([2.0, 0.5, -1.0], (5, 1)), atol=1e-6)
    # head 1 keeps its random weights: the head_size x head_size shortcut gives the nonzero
    # eigenvalues of the full embed x embed matrix Q_1 K_1^T
    q1, k1 = circuits.q[2, 1], circuits.k[2, 1]
    full = np.linalg.eigvals(q1 @ k1.T)
    nonzero = full[np.argsort(-np.abs(full))[:D]]
    shortcut = qk_spectrum(circuits)[2, 1]
    np.testing.assert_allclose(np.sort_complex(shortcut), np.sort_complex(nonzero), rtol=1e-6, atol=1e-12)
    assert np.abs(nonzero).min() > 1e-6

    summary = analyze_spectra(model, str(tmp_path), num_times=5)
    assert summary["qk_relative_variation"] == 0.0 and summary["ov_relative_variation"] == 0.0
    assert all((tmp_path / name).stat().st_size > 5_000 for name in ("spectra_qk.png", "spectra_ov.png"))


def test_generator_circuits_are_the_generated_weights(tiny_gpt2):
    config, model = tiny_gpt2
    circuits = circuits_of(model, num_times=3)
    np.testing.assert_allclose(circuits.depth, [0.0, 0.5, 1.0])
    w = model.generator(0.5)
    q2, o3 = w["q"]["heads", 2].rearrange(("embed", "head_size")), w["o"]["heads", 3].rearrange(("head_size", "embed"))
    np.testing.assert_allclose(circuits.q[1, 2], q2.array, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(circuits.o[1, 3], o3.array, rtol=1e-5, atol=1e-6)
    assert not np.allclose(circuits.q[0], circuits.q[2])  # W(t) really depends on t


def test_gpt2_reads_the_layer_that_was_set():
    from levanter.models.gpt2 import Gpt2Config

    model = filled(Gpt2Config(max_seq_len=8, hidden_dim=E, num_heads=2, num_layers=3))
    c_attn = model.transformer.blocks.stacked.attn.c_attn.weight  # [layers, embed, qkv, heads, head_size]
    assert [a.name for a in c_attn.axes] == ["layers", "embed", "qkv", "heads", "head_size"]
    array = c_attn.array.at[1, :, 0, 1, :].set(Q0).at[1, :, 1, 1, :].set(K0).at[1, :, 2, 1, :].set(V0)
    c_proj = model.transformer.blocks.stacked.attn.c_proj.weight  # [layers, heads, head_size, embed]
    model = eqx.tree_at(lambda m: m.transformer.blocks.stacked.attn.c_attn.weight, model, hax.named(array, c_attn.axes))
    c_proj = hax.named(c_proj.array.at[1, 1].set(O0), c_proj.axes)
    model = eqx.tree_at(lambda m: m.transformer.blocks.stacked.attn.c_proj.weight, model, c_proj)
    circuits = circuits_of(model, num_times=99)  # ignored for a layer stack
    assert circuits.depth_label == "layer" and list(circuits.depth) == [0, 1, 2]
    qk, ov = sorted_real(qk_spectrum(circuits)), sorted_real(ov_spectrum(circuits))
    np.testing.assert_allclose(qk[1, 1], [3.0, 2.0, 1.0], atol=1e-6)
    np.testing.assert_allclose(ov[1, 1], [2.0, 0.5, -1.0], atol=1e-6)
    # neither the same head in another layer nor another head in the same layer was set
    assert not np.allclose(qk[0, 1], [3, 2, 1], atol=1e-2) and not np.allclose(qk[1, 0], [3, 2, 1], atol=1e-2)


@pytest.mark.parametrize("scan_layers", [True, False])
def test_llama_grouped_query_heads_are_numbered_as_levanter_flattens_them(scan_layers):
    from levanter.models.llama import LlamaConfig

    shape = dict(max_seq_len=8, hidden_dim=2 * E, num_heads=4, num_kv_heads=2, num_layers=3, intermediate_dim=16)
    config = LlamaConfig(**shape, scan_layers=scan_layers)
    model = filled(config)
    layer = 2

    def attn(m):
        layers = m.transformer.layers
        return layers.stacked.self_attn if scan_layers else layers.blocks[layer].self_attn

    lead = (layer,) if scan_layers else ()
    # head 3 = kv group 1, member 1; heads 2 and 3 share K_1 and V_1
    Q, K, V = (np.vstack([m, np.zeros((E, D))]) for m in (Q0, K0, V0))
    O = np.hstack([O0, np.zeros((D, E))])  # noqa: E741 (the paper's name for the output map)
    a = attn(model)
    q, k, v, o = a.q_proj.weight, a.k_proj.weight, a.v_proj.weight, a.o_proj.weight
    names = lambda w: [a.name for a in w.axes][len(lead) :]  # noqa: E731
    assert names(q) == ["kv_head", "q_heads_per_group", "head_size", "embed"]
    assert names(o) == ["embed", "heads", "head_size"]
    model = eqx.tree_at(
        lambda m: (attn(m).q_proj.weight, attn(m).k_proj.weight, attn(m).v_proj.weight, attn(m).o_proj.weight),
        model,
        (
            hax.named(q.array.at[(*lead, 1, 1)].set(Q.T), q.axes),
            hax.named(k.array.at[(*lead, 1)].set(K.T), k.axes),
            hax.named(v.array.at[(*lead, 1)].set(V.T), v.axes),
            hax.named(o.array.at[(*lead, slice(None), 3)].set(O.T), o.axes),
        ),
    )
    circuits = circuits_of(model, num_times=2)
    qk, ov = sorted_real(qk_spectrum(circuits)), sorted_real(ov_spectrum(circuits))
    np.testing.assert_allclose(qk[layer, 3, :3], [3.0, 2.0, 1.0], atol=1e-6)
    np.testing.assert_allclose(ov[layer, 3, :3], [2.0, 0.5, -1.0], atol=1e-6)
    np.testing.assert_allclose(circuits.k[layer, 2], K)  # head 2 shares the group's keys ...
    assert not np.allclose(qk[layer, 2, :3], [3.0, 2.0, 1.0], atol=1e-2)  # ... but not the queries


def test_relative_variation_is_zero_for_constant_and_larger_for_jumps():
    constant = np.tile([[3.0, 1.0, -2.0]], (10, 1))
    assert relative_variation(constant) == 0.0
    # exact value: steps |2-1| and |1-2| average 1; norms 1, 2, 1 average 4/3
    assert relative_variation(np.array([[1.0], [2.0], [1.0]])) == pytest.approx(0.75)
    t = np.linspace(0, 1, 10)[:, None]
    smooth = np.hstack([1 + t, -2 + 0.5 * t])
    jumpy = smooth.copy()
    jumpy[1::2] *= -1.0  # the same magnitudes, alternating signs
    assert 0 < relative_variation(smooth) < 0.2 < relative_variation(jumpy)
