"""The device's dense matmul rate, measured: the denominator of the "fraction of peak" figures."""

import time

import jax
import jax.numpy as jnp
import numpy as np

DEFAULT_SIZE = {"cpu": 1024}  # accelerators: 8192


def matmul_peak(dtype=jnp.float32, *, size: int | None = None, repeats: int = 5) -> dict:
    """Median FLOP/s of an n x n x n matmul in `dtype` on the default device (2 n^3 FLOPs each)."""
    platform = jax.devices()[0].platform
    n = size or DEFAULT_SIZE.get(platform, 8192)
    ka, kb = jax.random.split(jax.random.PRNGKey(0))
    a = jax.random.normal(ka, (n, n), dtype)
    b = jax.random.normal(kb, (n, n), dtype)
    f = jax.jit(lambda a, b: a @ b).lower(a, b).compile()
    f(a, b).block_until_ready()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        f(a, b).block_until_ready()
        times.append(time.perf_counter() - start)
    median = float(np.median(times))
    return {"size": n, "dtype": jnp.dtype(dtype).name, "median_s": median, "flops_per_s": 2.0 * n**3 / median}
