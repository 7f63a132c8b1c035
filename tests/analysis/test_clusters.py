"""The particle system of appendix C.8: constant weights cluster, fast-growing weights do not."""

import numpy as np
import pytest

from qkvflow.analysis.clusters import (
    EXPONENTS,
    count_clusters,
    dispersion,
    initial_positions,
    scaling,
    simulate,
    velocity,
)


def test_constant_weights_cluster_and_faster_than_linear_growth_does_not():
    x0 = initial_positions(40, seed=0)
    final = {name: simulate(scaling(EXPONENTS[name]), x0)[-1] for name in ("f0", "f1", "f4")}
    assert count_clusters(x0) == 40 and dispersion(x0) > 1.2  # spread out to start with
    assert count_clusters(final["f0"]) <= 3 and dispersion(final["f0"]) < 0.05
    assert dispersion(final["f4"]) > dispersion(final["f1"]) + 0.1
    assert count_clusters(final["f4"]) > 2 * count_clusters(final["f1"])
    np.testing.assert_allclose(np.linalg.norm(final["f4"], axis=1), 1.0)  # tokens stay on the sphere


def test_measures_on_known_points():
    assert dispersion(np.array([[0.0, 0.0, 1.0], [0.0, 0.0, -1.0]])) == pytest.approx(2.0)
    z, x, y = np.eye(3)[2], np.eye(3)[0], np.eye(3)[1]
    points = np.array([z, z + 0.01, z - 0.01, x, x + 0.02, y])  # groups of 3, 2 and 1
    assert count_clusters(points) == 3
    chain = np.array([[0.04 * k, 0.0, 0.0] for k in range(10)])  # each within r of the next: single linkage
    assert count_clusters(chain) == 1 and count_clusters(chain, radius=0.03) == 10


def test_velocity_is_tangent_to_the_sphere_and_scales_with_the_weights():
    x = initial_positions(10, seed=3)
    v = velocity(x, 1.0, np.eye(3), np.eye(3))
    np.testing.assert_allclose(np.sum(v * x, axis=1), 0.0, atol=1e-12)
    assert np.abs(v).max() > 0.05
    # with a vanishing scale attention is uniform and V = s I: v_i = s P_{x_i}(mean_j x_j)
    s = 1e-4
    mean = x.mean(axis=0)
    expected = s * (mean - np.sum(mean * x, axis=1, keepdims=True) * x)
    np.testing.assert_allclose(velocity(x, s, np.eye(3), np.eye(3)), expected, rtol=1e-3, atol=1e-12)
