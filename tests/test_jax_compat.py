"""qkvflow._jax_compat: on a jax without `jax.core.is_constant_dim` (0.11 removed it; marin-haliax 0.2.20
calls it in every `hax.dot`), importing qkvflow puts it back and Haliax's products run. jax 0.11 is
simulated on the installed jax by hiding the aliases from `jax.core`."""

import importlib

import haliax as hax
import jax
import jax._src.core as src
import numpy as np
import pytest

import qkvflow
from qkvflow import _jax_compat


@pytest.fixture
def jax_011(monkeypatch):
    """jax.core as jax 0.11 has it: none of NAMES, neither set nor served as a deprecated alias."""
    served = jax.core.__getattr__

    def getattr_011(name):
        if name in _jax_compat.NAMES:
            raise AttributeError(f"module 'jax.core' has no attribute {name!r}")
        return served(name)

    for name in _jax_compat.NAMES:
        monkeypatch.setattr(jax.core, name, None, raising=False)  # so that teardown removes what restore() sets
        monkeypatch.delattr(jax.core, name)
    monkeypatch.setattr(jax.core, "__getattr__", getattr_011)
    assert not hasattr(jax.core, "is_constant_dim")


def named_dot():
    """hax.dot of two named arrays, and the same product by numpy."""
    A, B, C = hax.Axis("a", 3), hax.Axis("b", 4), hax.Axis("c", 5)
    x = hax.random.normal(jax.random.PRNGKey(0), (A, B))
    y = hax.random.normal(jax.random.PRNGKey(1), (B, C))
    expected = np.asarray(x.array, np.float64) @ np.asarray(y.array, np.float64)
    return hax.dot(x, y, axis=B), expected


def test_haliax_dot_needs_the_alias_and_runs_once_restored(jax_011):
    with pytest.raises(AttributeError, match="is_constant_dim"):
        named_dot()
    assert _jax_compat.restore() == list(_jax_compat.NAMES)
    out, expected = named_dot()
    np.testing.assert_allclose(np.asarray(out.array), expected, rtol=1e-5, atol=1e-6)  # f32 products of 4 terms
    assert _jax_compat.restore() == []  # nothing left to put back


def test_importing_qkvflow_applies_it_on_jax_011(jax_011, monkeypatch):
    monkeypatch.setattr(_jax_compat, "jax_removed_them", lambda version=None: True)
    importlib.reload(qkvflow)
    assert jax.core.is_constant_dim is src.is_constant_dim
    named_dot()


def test_jax_010_is_left_alone():
    """The installed jax (0.10) serves the aliases itself: nothing is set."""
    before = {n: n in vars(jax.core) for n in _jax_compat.NAMES}
    assert _jax_compat.restore() == [] and {n: n in vars(jax.core) for n in _jax_compat.NAMES} == before


@pytest.mark.parametrize(
    "version, removed",
    [("0.10.2", False), ("0.4.38", False), ("0.11.0", True), ("0.11.2", True), ("1.0.0", True), ("0.11.0rc1", True)],
)
def test_version_threshold(version, removed):
    assert _jax_compat.jax_removed_them(version) is removed


def test_own_is_constant_dim_matches_jax():
    symbolic = jax.export.symbolic_shape("b")[0]
    for d in (0, 7, np.int64(3), symbolic, 2 * symbolic):
        assert _jax_compat.is_constant_dim(d) == src.is_constant_dim(d), d
    assert _jax_compat.is_constant_dim(7) and not _jax_compat.is_constant_dim(symbolic)
