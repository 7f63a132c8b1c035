"""qkvflow: neural-ODE transformers (DiffEqFormer) on JAX, diffrax and Levanter."""

from qkvflow import _jax_compat

__version__ = "0.3.0"

if _jax_compat.jax_removed_them():  # jax >= 0.11: put back the jax.core aliases marin-haliax still calls
    _jax_compat.restore()
