"""The plan as text: one screen, per device."""

from __future__ import annotations

import textwrap


def gib(n) -> str:
    """Bytes in GiB, or in MiB / KiB when under one of the larger unit."""
    if n is None:
        return "n/a"
    for unit, size in (("GiB", 2**30), ("MiB", 2**20)):
        if n >= size:
            return f"{n / size:,.2f} {unit}"
    return f"{n / 2**10:,.2f} KiB"


def _seconds(s) -> str:
    if s is None:
        return "n/a"
    return f"{s * 1e3:,.1f} ms" if s >= 1e-3 else f"{s * 1e6:,.1f} us"


def text(p: dict) -> str:
    m, e, k = p["memory"], p["estimate"], p["kernels"]
    b = p["batch"]
    mfu = "n/a" if e["mfu"] is None else f"{e['mfu']:.0%}"
    mesh = " x ".join(f"{name} {size}" for name, size in p["mesh"].items() if size > 1) or "1 device"
    nodes = f" in {p['nodes']} nodes" if p.get("nodes", 1) > 1 else ""
    lines = [
        f"{p['model_type']} on {p['devices']} x {p['target']}{nodes} (mesh: {mesh}), "
        f"batch {b['global']} x {b['seq_len']} tokens ({b['per_device']} per device), compute {p['compute_dtype']}",
        "",
        "memory per device (XLA's accounting of the compiled step):",
        f"  parameters          {gib(m['parameters'])}",
        f"  optimizer state     {gib(m['optimizer_state'])}",
        f"  batch               {gib(m['batch'])}",
        f"  temporaries         {gib(m['temporaries'])}  (gradients among them: {gib(m['gradients'])})",
        f"  step needs          {gib(m['total'])}  of {gib(m['usable'])} usable: {m['usable_is']}",
        f"  => {'fits' if p['fits'] else 'does NOT fit'}",
    ]
    if "max_batch" in p:
        mb = p["max_batch"]
        exact = "" if mb["exact"] else " (search stopped at its compile limit: at least this)"
        lines.append(
            f"  largest batch that fits: {mb['per_device']} per device, {mb['global']} in all{exact}; "
            f"{mb['compiles']} compiles"
        )
    lines += [
        "",
        f"attention kernel: {', '.join(p['attention']['kernels'])} (attn_backend {p['attention']['config']})",
        f"kernel launches per step: {k['launches']:,} ({k['static']:,} in the program, {k['fusions']:,} fusions; "
        f"{k['once_per_step']:,} outside loops), as XLA's GPU runtime issues them",
    ]
    if p["platform"] == "gpu":  # a TPU runs its loops and branches on the chip
        lines.append(
            f"host synchronisations per step: {k['host_syncs']:,} ({k['host_syncs_by']['while']:,} in loops without "
            f"a known trip count, {k['host_syncs_by']['conditional']:,} at conditionals)"
        )
    if k["unknown_trip_counts"]:
        lines.append(
            f"  {k['unknown_trip_counts']} loops without a known trip count taken to run "
            f"{e['unknown_trip_counts_taken_as']} times"
        )
    if p["collectives"]:
        lines.append("collectives per step:")
        for kind, c in sorted(p["collectives"].items()):
            sizes = ", ".join(str(n) for n in c["group_sizes"])
            across = f"; {gib(c['network_bytes'])} across nodes" if c["network_bytes"] else ""
            lines.append(f"  {kind:<18} {c['count']:>6,} x, {gib(c['bytes'])} in all, groups of {sizes}{across}")
    else:
        lines.append("collectives per step: none")
    lines += [
        "",
        "ESTIMATE (a roofline, not a measurement: every kernel at peak FLOP/s or full memory bandwidth, no",
        "overlap of communication with compute, no launch overhead; matmuls not autotuned here):",
        f"  step time {_seconds(e['step_s'])} = kernels {_seconds(e['kernels_s'])} "
        f"(compute {_seconds(e['compute_s'])}, memory {_seconds(e['memory_s'])}) + collectives {_seconds(e['collectives_s'])}",
        f"  MFU {mfu}  (model FLOPs {e['model_flops']:.3g} per device; {e['hlo_flops']:.3g} counted in the program)",
    ]
    lines += calibrated(e.get("calibrated"), p["target"])
    lines.append(f"compiled in {p['compile_s']} s (the step's XLA compile, on this machine)")
    return "\n".join(lines)


def calibrated(c: dict | None, target: str) -> list[str]:
    """The calibrated estimate's lines (qkvflow.plan.calibration), or the one line saying there is none."""
    if not c or not c["calibrated"]:
        why = c["why"] if c else "no calibration"
        return [f"NOT CALIBRATED for {target}: {why} (the roofline above is not a prediction)"]
    k = c["coefficients"]
    mfu = "n/a" if c["mfu"] is None else f"{c['mfu']:.0%}"
    return [
        f"CALIBRATED on {len(c['rows'])} measured {target} steps ({c['source']}):",
        f"  step time {_seconds(c['step_s'])} ({_seconds(c['low_s'])} to {_seconds(c['high_s'])}: the rows' worst "
        f"error left out of the fit, {c['band']:.1%}), MFU {mfu}",
        f"  = {k['roofline_s']:.3g} x roofline + {k['launches'] * 1e6:.3g} us x launches "
        f"+ {k['host_syncs'] * 1e6:.3g} us x host synchronisations",
        "  rows (commit, measured step):",
        *(f"    {r}" for r in c["rows"]),
        *textwrap.wrap(f"scope: {c['scope']}", 104, initial_indent="  ", subsequent_indent="    "),
    ]
