"""`normal(key, axes)`: `haliax.random.normal`'s values, drawn as one flat vector and reshaped.

JAX's threefry generator gives element i of a draw of shape S the bits threefry(key, i), with i the
element's row-major index in S (with `jax_threefry_partitionable` on, JAX's default, and off: the
older scheme hashes the same flat counter), and turns bits into normals element by element. So

    normal(key, (a, b, c)) == normal(key, (a * b * c,)).reshape(a, b, c)     bit for bit,

and the flat draw is much cheaper to compile. On XLA's CPU backend a rank-4 draw (a DiffEqFormer's
generated Q, K, V and O: time_embed x embed x heads x head_dim) took 2.2 s to compile against 0.2 s
for a vector (jax 0.10.2, 2-core VM, a niced job beside it; 5.4 s against 1.1 s with two training
runs beside it):

    python -c "import time, jax; f = jax.jit(lambda k: jax.random.normal(k, (2, 3, 5, 8)));
    t = time.time(); f.lower(jax.random.PRNGKey(0)).compile(); print(time.time() - t)"   # or (240,)

A model's initialisation is one compiled program with one draw per generated matrix: the tiny test
model's (tests/configs/tiny_train.yaml) compiled in 7.0 s instead of 9.2 s, with the same parameters.
tests/nn/test_random.py pins the identity against `haliax.random.normal`.
"""

import math

import haliax as hax
import jax.random as jrandom
from haliax import NamedArray
from haliax.axis import AxisSpec, axis_spec_to_shape_dict


def normal(key, axes: AxisSpec, dtype=float) -> NamedArray:
    """Standard normal entries over the named `axes`, equal to `haliax.random.normal(key, axes, dtype)`."""
    shape = axis_spec_to_shape_dict(axes)
    sizes = tuple(shape.values())
    flat = jrandom.normal(key, (math.prod(sizes),), dtype)
    return hax.auto_sharded(hax.named(flat.reshape(sizes), tuple(shape)))
