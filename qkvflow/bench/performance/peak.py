"""A device's peak FLOP/s, the denominators of `qkvflow bench speed`'s figures: the dense matmul rate
measured in the same run (`matmul_peak`, for "fraction of peak"), and the nominal peak behind MFU
(`nominal_peak_flops`: Levanter's table, `fray.device_flops`, for the device kind and compute dtype, or
`--peak-flops`; none for a CPU). The model FLOPs are `qkvflow.models.accounting.train_flops_per_token`.
"""

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


def nominal_peak_flops(dtype: str, override: float | None) -> dict:
    """One device's peak FLOP/s for MFU: `--peak-flops`, else Levanter's table (`fray.device_flops`, what
    its trainer's MFU uses) for the device kind and compute dtype; None on a CPU or an unknown device."""
    device = jax.devices()[0]
    if override is not None:
        return {"flops_per_s": override, "source": "--peak-flops"}
    if device.platform == "cpu":
        return {"flops_per_s": None, "source": "none for a CPU (set --peak-flops)"}
    from fray.device_flops import device_flops_for_jax_device

    # f32 matmuls run at JAX's default precision (lax.Precision.DEFAULT): TF32 on GPUs, one bfloat16
    # pass on TPUs; their peak is that rate's, not the data sheet's plain-fp32 one.
    kind = "bf16" if dtype == "bf16" else {"gpu": "tf32", "tpu": "bf16"}.get(device.platform, "fp32")
    flops = device_flops_for_jax_device(device.device_kind, kind)
    return {
        "flops_per_s": flops,
        "source": f"fray.device_flops[{device.device_kind!r}, {kind}]"
        if flops
        else f"unknown device {device.device_kind!r} for {kind} (set --peak-flops)",
    }
