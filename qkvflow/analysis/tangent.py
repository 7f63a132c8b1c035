"""Lyapunov exponents of a flow by Euler steps of its tangent dynamics with QR re-orthonormalisation
(the paper's appendix B; the discrete QR method of Benettin et al., 1980).

Along a trajectory of dx/dt = f(t, x), perturbations follow the tangent dynamics

    dY/dt = J(t) Y,    J(t) = df/dx (t, x(t)),    Y(0) = I.

With Euler steps of size dt at t_k = t_0 + k dt, k = 0..N-1, and T = N dt:

    Z_{k+1} = Q_k + dt J(t_k) Q_k = Q_{k+1} R_{k+1}     (QR; Q_0 = I)
    lambda_m = (1/T) sum_{k=1}^{N} log |(R_k)_mm|

Since Y(t_N) = Q_N R_N ... R_1, the sums are exact for the Euler-discretised tangent map at any T,
and tend to the Lyapunov exponents (for a constant J, the real parts of its eigenvalues) as T grows.
For a constant upper-triangular J they equal log|1 + dt J_mm| / dt at every T.
"""

from typing import Callable

import jax
import jax.numpy as jnp


def qr_step(q: jax.Array, jq: jax.Array, dt) -> tuple[jax.Array, jax.Array]:
    """One step: Z = Q + dt (J Q) = Q' R; returns (Q', log|diag R|). q, jq: [d, k] with k <= d."""
    q_next, r = jnp.linalg.qr(q + dt * jq)
    diag = jnp.abs(jnp.diagonal(r))
    return q_next, jnp.log(jnp.maximum(diag, jnp.finfo(diag.dtype).tiny))


def lyapunov_spectrum(field: Callable, x0: jax.Array, *, num_steps: int, t1: float = 1.0, t0: float = 0.0) -> jax.Array:
    """[d] exponents lambda_m, in the order of the QR columns (not sorted), of dx/dt = field(t, x), x in R^d.

    The trajectory is integrated with the same Euler steps; J Q comes from forward-mode products
    (`jax.linearize`), so J is never formed.
    """
    dt = (t1 - t0) / num_steps

    def step(carry, k):
        x, q = carry
        dx, tangent = jax.linearize(lambda y: field(t0 + k * dt, y), x)
        jq = jax.vmap(tangent, in_axes=1, out_axes=1)(q)
        q, log_r = qr_step(q, jq, dt)
        return (x + dt * dx, q), log_r

    q0 = jnp.eye(x0.shape[0], dtype=x0.dtype)
    _, log_r = jax.lax.scan(step, (x0, q0), jnp.arange(num_steps))
    return log_r.sum(axis=0) / (t1 - t0)
