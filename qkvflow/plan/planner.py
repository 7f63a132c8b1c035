"""The plan of a config on a target: compile its training step, read what the compiled program says.

    plan(config, target, devices, vocab_size)  -> one JSON-able dict (docs/plan.md lists its keys)

Memory per device is XLA's own accounting of the compiled program (`memory_analysis()`): the step
needs arguments + outputs - aliased (donated) + temporaries, the number the H200 measured to 0.15%
(benchmarks/results/accelerator_h200_2026-11-26/). The arguments split into parameters, optimizer
state and the batch (their shards' sizes); the gradients are among the temporaries. A GPU program
fits when that total is at most the memory JAX lets XLA use: the device's memory times
XLA_PYTHON_CLIENT_MEM_FRACTION (JAX's default preallocation, 0.75, unless the variable is set).

`--max_batch`: memory grows about linearly in the batch (the state does not change; activations and
their temporaries scale with it): `largest_fitting` searches along that line, checking each guess by
compiling it, with bisection as the fallback; at most `MAX_COMPILES` compiles.
"""

from __future__ import annotations

import math
import os
import re

from qkvflow import outputs
from qkvflow.errors import UserError
from qkvflow.models.accounting import train_flops_per_token
from qkvflow.plan import backend, calibration, hlo, roofline, step
from qkvflow.plan.targets import Target

MEM_FRACTION_DEFAULT = 0.75
"""JAX's default XLA_PYTHON_CLIENT_MEM_FRACTION on a GPU (JAX's "GPU memory allocation" page,
https://docs.jax.dev/en/latest/gpu_memory_allocation.html)."""

TPU_MEM_FRACTION = 1.0
"""The part of a TPU's HBM the plan counts as usable: all of it. JAX's preallocation and its
XLA_PYTHON_CLIENT_MEM_FRACTION belong to the GPU allocator (the page above) and do not apply; XLA:TPU
checks a program against the chip's HBM itself (a compile past it fails with "Ran out of memory in
memory space hbm", the check MaxText's train_compile.py relies on). A plan that needs the whole HBM
is therefore at the edge: the runtime keeps a little for itself."""

MAX_COMPILES = 8


def usable_memory(target: Target) -> tuple[int, str]:
    """(bytes the program may use on one device, why): a GPU's memory times XLA_PYTHON_CLIENT_MEM_FRACTION
    (JAX's default 0.75), a TPU's times TPU_MEM_FRACTION, a CPU device's nominal memory."""
    if target.platform == "tpu":
        return int(TPU_MEM_FRACTION * target.memory_bytes), f"{TPU_MEM_FRACTION:g} of the chip's HBM (XLA:TPU's limit)"
    if target.platform != "gpu":
        return target.memory_bytes, "the device's memory"
    raw = os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION")
    try:
        fraction = float(raw) if raw else MEM_FRACTION_DEFAULT
    except ValueError:
        raise UserError(f"XLA_PYTHON_CLIENT_MEM_FRACTION={raw!r} is invalid: expected a fraction such as 0.9") from None
    why = f"{fraction:g} of the device's memory (XLA_PYTHON_CLIENT_MEM_FRACTION{'' if raw else ', JAX default'})"
    return int(fraction * target.memory_bytes), why


def memory(compiled: step.Compiled) -> dict:
    """Per-device bytes of the compiled step."""
    m = compiled.executable.memory_analysis()
    total = m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes + m.temp_size_in_bytes
    return {
        "parameters": compiled.params_bytes,
        "optimizer_state": compiled.optimizer_bytes,
        "batch": compiled.batch_bytes,
        "gradients": compiled.trainable_params_bytes,
        "arguments": m.argument_size_in_bytes,
        "outputs": m.output_size_in_bytes,
        "aliased": m.alias_size_in_bytes,
        "temporaries": m.temp_size_in_bytes,
        "total": total,
    }


def unknown_trips(model_config) -> int:
    """What a loop XLA has no trip count for is taken to run: a fixed-step ODE's steps (diffrax's
    while loops are the ones without); 1 otherwise."""
    ode = getattr(model_config, "ode", None)
    if ode is not None and not ode.is_adaptive:
        return int(ode.num_steps)
    return 1


def tpu_slices(config) -> int:
    """The TPU slices a plan compiles for: the product of `trainer.mesh.dcn_axes`' sizes (the axes
    Levanter lays across slices; its default, replica_dcn -1, takes however many there are: 1 here)."""
    dcn = getattr(getattr(getattr(config, "trainer", None), "mesh", None), "dcn_axes", None) or {}
    return math.prod(int(v) for v in dcn.values() if int(v) > 0)


def model_flops_per_device(config, vocab: int, batch: int, devices: int) -> float:
    tokens = batch * config.model.max_seq_len
    return train_flops_per_token(config.model, vocab, tokens)["train_per_token"] * tokens / devices


def largest_fitting(total, start: int, limit: int, max_compiles: int = MAX_COMPILES, known: dict | None = None) -> dict:
    """The largest batch b >= 1 with total(b) <= limit, for a `total` that grows with b (about linearly);
    `known`: b -> total(b) already computed. Each step tries the line through the two nearest points
    when its guess lies strictly between the largest batch known to fit and the smallest known not to,
    else the midpoint (or, with no upper bound yet, twice the largest that fits). `exact` is False when
    the compiles ran out first (`per_device` is then the largest seen to fit)."""
    known = dict(known or {})

    def bounds():
        fit = max((b for b, m in known.items() if m <= limit), default=0)
        over = min((b for b, m in known.items() if m > limit), default=None)
        return fit, over

    def guess(fit, over):
        points = sorted(known.items())
        if len(points) >= 2:
            (b1, m1), (b2, m2) = sorted(points, key=lambda p: abs(p[0] - fit))[:2]
            if b1 != b2 and m2 != m1:
                g = int(b1 + (limit - m1) * (b2 - b1) // (m2 - m1))
                g = g + 1 if g == fit else g
                if g > fit and (over is None or g < over):
                    return g
        return 2 * max(fit, 1) if over is None else (fit + over) // 2

    if start not in known:
        known[start] = total(start)
    fit, over = bounds()
    while over is None or over - fit > 1:
        if len(known) >= max_compiles:
            return {"per_device": fit, "compiles": len(known), "exact": False}
        b = guess(fit, over)
        known[b] = total(b)
        fit, over = bounds()
    return {"per_device": fit, "compiles": len(known), "exact": True}


def calibrated_estimate(p: dict, target: Target) -> dict:
    """The roofline corrected by `target`'s calibration (qkvflow.plan.calibration), from the plan's own
    roofline time, launches and host synchronisations."""
    e, k = p["estimate"], p["kernels"]
    feats = {"roofline_s": e["step_s"], "launches": k["launches"], "host_syncs": k.get("host_syncs", 0)}
    return calibration.calibrated(feats, target.name, e["model_flops"], target.peak_flops.get(p["compute_dtype"]))


ATTENTION = re.compile(r"fmha|attention|splash|flash|mha", re.IGNORECASE)


def attention_kernels(module) -> list[str]:
    """The custom calls that are attention kernels: cuDNN's by target (`__cudnn$fmha...`), a Pallas
    kernel on a TPU by its name (`splash_mha_fwd...`: the target is `tpu_custom_call`)."""
    found = set()
    for instr, _ in hlo.walk(module):
        if instr.opcode != "custom-call":
            continue
        target = (instr.attr("custom_call_target") or "").strip('"')
        label = re.sub(r"\.\d+$", "", instr.name) if target == "tpu_custom_call" else target
        if ATTENTION.search(label):
            found.add(label)
    return sorted(found)


def plan(
    config, target: Target, devices: int, vocab: int, *, search_max_batch: bool = False, hlo_file=None, overwrite=False
) -> dict:
    """Compile `config`'s training step for `devices` of `target`; the plan as one JSON-able dict
    (and the optimised HLO text in `hlo_file`, if given, as every output file: `qkvflow.outputs`)."""
    if devices < 1:
        raise UserError(f"--devices {devices} is invalid: expected an integer >= 1")
    slices = tpu_slices(config) if target.platform == "tpu" else 1
    found = backend.devices_for(target, devices, slices)
    if len(found) != devices:
        raise UserError(f"--target {target.name} gave {len(found)} devices, not --devices {devices}")
    compiled = step.compile_step(config, target, found, vocab)
    text = compiled.executable.as_text()
    if hlo_file:
        outputs.write_file(hlo_file, "--save_hlo", text, overwrite=overwrite)
    module = hlo.parse(text)
    mem = memory(compiled)
    limit, why = usable_memory(target)
    trips = unknown_trips(config.model)
    dp = step.data_parallel(compiled.mesh_shape)
    kernels = hlo.count_kernels(module, unknown_trip_count=trips)
    # a TPU multi-slice program is one slice's: its partitions never leave the slice (hlo.MEGASCALE)
    nodes = (list(compiled.partition_nodes) or None) if slices == 1 else None
    attention = attention_kernels(module)
    # XLA:TPU writes matrix products as convolutions (batched ones with windows), which the roofline
    # does not count: no time estimate there rather than one without most of its FLOPs
    peak = target.peak_flops.get(compiled.compute_dtype) if target.platform == "gpu" else None
    out = {
        "target": target.name,
        "platform": target.platform,
        "devices": devices,
        "nodes": len(set(compiled.partition_nodes or [0])),
        "mesh": compiled.mesh_shape,
        "model_type": type(config.model).__name__,
        "vocab_size": compiled.vocab_size,
        "batch": {"global": compiled.batch, "per_device": compiled.batch // dp, "seq_len": config.model.max_seq_len},
        "compute_dtype": compiled.compute_dtype,
        "attention": {
            "config": compiled.attention,
            "kernels": attention or ["no attention custom call (XLA's own ops)"],
        },
        "memory": {**mem, "usable": limit, "usable_is": why, "device": target.memory_bytes},
        "fits": mem["total"] <= limit,
        "kernels": kernels,
        "collectives": hlo.collectives(module, unknown_trip_count=trips, nodes=nodes, slices=slices),
        "estimate": roofline.estimate(
            module,
            peak_flops=peak,
            f32_peak_flops=target.peak_flops.get("float32") if peak else None,
            hbm_bytes_per_s=target.hbm_bytes_per_s,
            link_bytes_per_s=target.link_bytes_per_s,
            network_bytes_per_s=target.network_bytes_per_s,
            devices_per_node=target.devices_per_node,
            model_flops=model_flops_per_device(config, vocab, compiled.batch, devices),
            unknown_trip_count=trips,
            nodes=nodes,
        ),  # fmt: skip
        "compile_s": round(compiled.compile_s, 1),
    }
    out["estimate"]["unknown_trip_counts_taken_as"] = trips
    out["estimate"]["calibrated"] = calibrated_estimate(out, target)
    if search_max_batch:

        def total(per_device: int) -> int:
            return memory(step.compile_step(config, target, found, vocab, batch=per_device * dp))["total"]

        per_device = compiled.batch // dp
        out["max_batch"] = largest_fitting(total, per_device, limit, known={per_device: mem["total"]})
        out["max_batch"]["global"] = out["max_batch"]["per_device"] * dp
    return out
