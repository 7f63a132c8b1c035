"""The FLOPs of `qkvflow bench speed`'s MFU: the model's per token, and the device's nominal peak.

Model FLOPs are Levanter's convention, 3 x forward (the ODE's forward includes its hypernetwork; none
include rematerialisation). The peak is one device's, from Levanter's table (`fray.device_flops`) for the
device kind and compute dtype, or `--peak-flops`; there is none for a CPU.
"""

import jax

from qkvflow.models import accounting, registry


def train_flops_per_token(config, vocab: int, tokens_per_batch: int) -> dict:
    """Model FLOPs of one training step per token: 3 x forward, plus the hypernetwork's share.
    Attention's FLOPs are at the full context (`max_seq_len`), as every benchmark step uses it."""
    forward = float(config.flops_per_token(vocab, config.max_seq_len))
    hyper = 0.0
    if registry.is_ode(config):
        hyper = accounting.hypernetwork_flops_per_forward(config, vocab) / tokens_per_batch
    return {
        "forward_per_token": forward,
        "hypernetwork_forward_per_token": hyper,
        "train_per_token": 3.0 * (forward + hyper),
    }


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
