"""The QR tangent integrator on linear fields dx/dt = A x, whose exponents are known."""

import jax.numpy as jnp
import numpy as np

from qkvflow.analysis.tangent import lyapunov_spectrum


def test_triangular_field_gives_its_diagonal_exactly():
    # For upper-triangular A every Euler tangent step is triangular, so the QR sums are exactly
    # log|1 + dt a_mm| / dt at any horizon, close to a_mm for small dt.
    A = jnp.array([[0.5, 3.0, -1.0], [0.0, -1.0, 2.0], [0.0, 0.0, 2.0]])
    n = 200
    exponents = np.asarray(lyapunov_spectrum(lambda t, x: A @ x, jnp.ones(3), num_steps=n))
    dt = 1.0 / n
    np.testing.assert_allclose(exponents, np.log(np.abs(1 + dt * np.diag(A))) / dt, rtol=1e-4)
    np.testing.assert_allclose(exponents, np.diag(A), atol=0.02)


def test_general_field_gives_real_parts_of_eigenvalues():
    # A = S B S^-1 with eigenvalues 0.3 +- 2i and -0.5, mixed by a non-orthogonal S: the exponents
    # converge to those of the Euler map I + dt A, log|1 + dt lambda| / dt (0.319, 0.319, -0.501 at
    # dt = 0.01), which tend to the real parts (0.3, 0.3, -0.5) as dt -> 0.
    B = np.array([[0.3, -2.0, 0.0], [2.0, 0.3, 0.0], [0.0, 0.0, -0.5]])
    S = np.array([[1.0, 0.5, 0.2], [0.0, 1.0, -0.4], [0.3, 0.0, 1.0]])
    A = jnp.asarray(S @ B @ np.linalg.inv(S))
    assert not np.allclose(np.asarray(A), np.triu(np.asarray(A)))
    T = 40.0
    exponents = np.sort(np.asarray(lyapunov_spectrum(lambda t, x: A @ x, jnp.ones(3), num_steps=4000, t1=T)))[::-1]
    eigenvalues = np.linalg.eigvals(B)
    euler = np.sort(np.log(np.abs(1 + 0.01 * eigenvalues)) / 0.01)[::-1]
    np.testing.assert_allclose(exponents, euler, atol=0.015)
    np.testing.assert_allclose(exponents, np.sort(eigenvalues.real)[::-1], atol=0.04)
    short = lyapunov_spectrum(lambda t, x: A @ x, jnp.ones(3), num_steps=100, t1=1.0)
    assert np.abs(np.sort(np.asarray(short))[::-1] - [0.3, 0.3, -0.5]).max() > 0.1  # finite horizon differs


def test_time_dependent_scalar_field_integrates_the_rate():
    # dx/dt = a(t) x with a(t) = 2t: the exponent over [0, 1] is int_0^1 a = 1 (Euler's left sum: 1 - 1/N)
    n = 1000
    exponent = lyapunov_spectrum(lambda t, x: 2 * t * x, jnp.ones(1), num_steps=n)
    np.testing.assert_allclose(float(exponent[0]), 1.0 - 1.0 / n, atol=2e-3)
