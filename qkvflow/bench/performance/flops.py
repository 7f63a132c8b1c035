"""The peak of `qkvflow bench speed`'s MFU (its model FLOPs are `qkvflow.models.accounting.train_flops_per_token`).

The peak is one device's, from Levanter's table (`fray.device_flops`) for the
device kind and compute dtype, or `--peak-flops`; there is none for a CPU.
"""

import jax


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
