"""qkvflow: neural-ODE transformers (DiffEqFormer) on JAX, diffrax and Levanter."""

__version__ = "0.2.0"
