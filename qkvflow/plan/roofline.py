"""A roofline estimate of one training step from its optimised HLO: an estimate, not a measurement.

Each kernel k (qkvflow.plan.hlo.walk, loops weighted by trip count) takes

    t_k = max(F_k / P, B_k / W)

with F_k its matmul FLOPs, B_k the bytes it reads and writes in device memory, P the device's dense
peak for the compute dtype (a product whose operands are both f32 is charged at the f32 peak, TF32 on
these GPUs, when that one is given: a bf16 step's loss can take f32 products) and W its memory
bandwidth (Williams, Waterman & Patterson, "Roofline", CACM 2009). F_k: 2 x (result elements) x
(contracted size) for each `dot` in the kernel (in a fusion, in its fused computation), the same
from a cuBLAS GEMM's dimension numbers, and for cuDNN's fused attention 4 B H S_q S_kv D forward and
2.5 times that backward (FlashAttention-2's count), halved for a causal mask. Everything else
(elementwise work, reductions) is counted as bytes only. B_k: its operands plus its result, except
that an operand a fusion only reads through `dynamic-slice` counts as the slices read, and a fusion
whose root is a `dynamic-update-slice` writes in place: the update's bytes, not the buffer's. Each
collective takes its ring traffic over the link:

    all-gather, reduce-scatter: (n - 1)/n x bytes / L;  all-reduce: 2 (n - 1)/n x bytes / L

with n the group size and L the one-direction bandwidth to another device: NVLink (or ICI) when
every group stays inside a node, the network (InfiniBand, DCN) when a group spans two nodes
(`collective_bytes_sent`, of which `network_bytes_sent` over the network). The step is the
kernels' sum plus the collectives' sum: no overlap of communication with compute, no launch
overhead, every kernel at peak or at full bandwidth, so the truth can be slower (a kernel below its
roofline) or faster (overlap).
MFU = model FLOPs per step / (step time x P), the model FLOPs being Levanter's 3 x forward.
"""

from __future__ import annotations

import math

from qkvflow.plan import groups, hlo


def _dot_flops(module: hlo.Module, instr: hlo.Instr) -> float:
    (_, out), lhs = hlo.shapes(instr.type)[0], hlo.shapes(module.operand_types(instr)[0])[0][1]
    dims = instr.attr("lhs_contracting_dims") or "{}"
    contracted = math.prod(lhs[int(d)] for d in dims.strip("{}").split(",") if d.strip())
    return 2.0 * math.prod(out) * contracted


def _custom_call_flops(module: hlo.Module, instr: hlo.Instr) -> float:
    target = (instr.attr("custom_call_target") or "").strip('"')
    config = instr.backend_config()
    if "gemm" in target or "matmul" in target:
        numbers = config.get("gemm_backend_config", config).get("dot_dimension_numbers", {})
        lhs = hlo.shapes(module.operand_types(instr)[0])[0][1]
        out = hlo.shapes(instr.type)[0][1]
        contracted = math.prod(lhs[int(d)] for d in numbers.get("lhs_contracting_dimensions", []))
        return 2.0 * math.prod(out) * contracted
    if "fmha" in target:
        operands = module.operand_types(instr)
        q = hlo.shapes(operands[0])[0][1]  # [B, S, H, D], jax's layout
        kv = hlo.shapes(operands[1])[0][1]
        if len(q) != 4 or len(kv) != 4:
            return 0.0
        forward = 4.0 * q[0] * q[2] * q[1] * kv[1] * q[3]
        causal = "CAUSAL" in str(config).upper()
        return forward * (2.5 if "Backward" in target else 1.0) * (0.5 if causal else 1.0)
    return 0.0


def _fused_flops(module: hlo.Module, name: str, f32_only: bool = False) -> float:
    total = 0.0
    for instr in module.computations.get(name, []):
        if instr.opcode == "dot" and (not f32_only or _f32_operands(module, instr)):
            total += _dot_flops(module, instr)
        elif instr.opcode == "fusion":
            total += sum(_fused_flops(module, c, f32_only) for c in instr.called("calls"))
    return total


def _f32_operands(module: hlo.Module, instr: hlo.Instr) -> bool:
    """Whether a product's two operands are f32 (it then runs at the f32 rate, TF32 on a GPU)."""
    dtypes = [hlo.shapes(t)[0][0] for t in module.operand_types(instr)[:2] if hlo.shapes(t)]
    return len(dtypes) == 2 and all(d == "f32" for d in dtypes)


def kernel_f32_flops(module: hlo.Module, instr: hlo.Instr) -> float:
    """The part of `kernel_flops` in products whose operands are both f32."""
    if instr.opcode == "fusion":
        return sum(_fused_flops(module, c, f32_only=True) for c in instr.called("calls"))
    if instr.opcode in ("dot", "custom-call") and _f32_operands(module, instr):
        return kernel_flops(module, instr)
    return 0.0


def kernel_flops(module: hlo.Module, instr: hlo.Instr) -> float:
    """Matmul FLOPs of one kernel launch."""
    if instr.opcode == "dot":
        return _dot_flops(module, instr)
    if instr.opcode == "custom-call":
        return _custom_call_flops(module, instr)
    if instr.opcode == "fusion":
        return sum(_fused_flops(module, c) for c in instr.called("calls"))
    return 0.0


def _fusion_bytes(module: hlo.Module, instr: hlo.Instr) -> float | None:
    (name,) = instr.called("calls") or [None]
    body = module.computations.get(name)
    if not body:
        return None
    users: dict = {}
    for i in body:
        for operand in i.operand_names():
            users.setdefault(operand, []).append(i)
    read = 0.0
    for param in (i for i in body if i.opcode == "parameter"):
        uses = users.get(param.name, [])
        if uses and all(u.opcode == "dynamic-slice" and u.operand_names()[:1] == [param.name] for u in uses):
            read += sum(hlo.nbytes(u.type) for u in uses)
        elif not any(u.opcode == "dynamic-update-slice" and u.operand_names()[:1] == [param.name] for u in uses):
            read += hlo.nbytes(param.type)
    root = next((i for i in body if i.root), None)
    if root is not None and root.opcode == "dynamic-update-slice":
        return read + hlo.nbytes(module.operand_types(root)[1])
    return read + hlo.nbytes(instr.type)


def kernel_bytes(module: hlo.Module, instr: hlo.Instr) -> float:
    """Bytes one kernel launch reads and writes in device memory."""
    if instr.opcode == "fusion":
        fused = _fusion_bytes(module, instr)
        if fused is not None:
            return fused
    return module.operand_bytes(instr) + hlo.nbytes(instr.type)


def ring_bytes(kind: str, size: float, n: int) -> float:
    """Bytes each device sends in a ring implementation of a collective over `n` devices."""
    if n <= 1:
        return 0.0
    if kind == "all-reduce":
        return 2.0 * (n - 1) / n * size
    if kind == "collective-permute":
        return size
    return (n - 1) / n * size


def kernels(text_or_module, *, peak_flops=None, hbm_bytes_per_s=None, unknown_trip_count: int = 1,
            f32_peak_flops=None):  # fmt: skip
    """One dict per kernel of the step, in program order: `instr` (the `hlo.Instr`), `launches` (per step,
    loops weighted), and per launch `flops` (`f32_flops` of them in products of two f32 operands),
    `bytes` and, with both rates given, `compute_s` (the f32 products at `f32_peak_flops` when given,
    the rest at `peak_flops`), `memory_s` and `seconds` (their maximum, the kernel's roofline; None
    otherwise). A collective gets `collective` (its kind) and no time here: `estimate` charges it to the link."""
    module = hlo._module(text_or_module)
    known = bool(peak_flops and hbm_bytes_per_s)
    for instr, weight in hlo.walk(module, unknown=unknown_trip_count):
        f, b = kernel_flops(module, instr), kernel_bytes(module, instr)
        f32 = kernel_f32_flops(module, instr) if f else 0.0
        kind = hlo.COLLECTIVES.get(instr.opcode)
        c = m = None
        if known and kind is None:
            c = (f - f32) / peak_flops + f32 / (f32_peak_flops or peak_flops)
            m = b / hbm_bytes_per_s
        yield {
            "instr": instr, "launches": weight, "flops": f, "f32_flops": f32, "bytes": b, "collective": kind,
            "compute_s": c, "memory_s": m, "seconds": None if c is None else max(c, m),
        }  # fmt: skip


def estimate(text_or_module, *, peak_flops, hbm_bytes_per_s, link_bytes_per_s, network_bytes_per_s=None,
             devices_per_node: int = 8, model_flops: float | None = None, unknown_trip_count: int = 1,
             f32_peak_flops=None, nodes=None) -> dict:  # fmt: skip
    """The roofline of one step (see the module docstring); None for the terms whose rate is unknown.
    `f32_flops` is the part of `hlo_flops` in products of two f32 operands. `nodes[d]` is the node of
    the program's partition d (default: d // devices_per_node); a collective whose groups all stay in
    one node runs at `link_bytes_per_s`, one with a group across nodes at `network_bytes_per_s`."""
    module = hlo._module(text_or_module)
    if nodes is None:
        nodes = [d // devices_per_node for d in range(module.num_partitions)]
    flops = f32_flops = hbm = compute_s = memory_s = kernel_s = comm_bytes = comm_s = network_bytes = 0.0
    rates = {"peak_flops": peak_flops, "hbm_bytes_per_s": hbm_bytes_per_s, "f32_peak_flops": f32_peak_flops}
    for k in kernels(module, unknown_trip_count=unknown_trip_count, **rates):
        instr, weight, kind = k["instr"], k["launches"], k["collective"]
        flops += weight * k["flops"]
        f32_flops += weight * k["f32_flops"]
        hbm += weight * k["bytes"]
        if kind is not None:
            found = groups.device_groups(instr.opcode, instr.attrs, module.num_partitions)
            n = max(len(g) for g in found)
            size = module.operand_bytes(instr) * (n if kind == "all-gather" else 1)
            sent = ring_bytes(kind, size, n)
            across = groups.crosses_nodes(found, nodes)
            rate = network_bytes_per_s if across and network_bytes_per_s else link_bytes_per_s
            network_bytes += weight * sent if across else 0.0
            comm_bytes += weight * sent
            comm_s += weight * sent / rate if rate else 0.0
            continue
        if k["seconds"] is not None:
            compute_s += weight * k["compute_s"]
            memory_s += weight * k["memory_s"]
            kernel_s += weight * k["seconds"]
    known = bool(peak_flops and hbm_bytes_per_s)
    step = kernel_s + comm_s if known and (comm_bytes == 0 or link_bytes_per_s) else None
    return {
        "hlo_flops": flops,
        "f32_flops": f32_flops,
        "hbm_bytes": hbm,
        "collective_bytes_sent": comm_bytes,
        "network_bytes_sent": network_bytes,
        "compute_s": compute_s if known else None,
        "memory_s": memory_s if known else None,
        "kernels_s": kernel_s if known else None,
        "collectives_s": comm_s if known else None,
        "step_s": step,
        "model_flops": model_flops,
        "mfu": model_flops / (step * peak_flops) if step and model_flops else None,
    }
