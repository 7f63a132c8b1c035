"""The roofline estimate calibrated on measured step times: a small fitted model of what it leaves out.

The roofline (qkvflow.plan.roofline) charges every kernel at peak FLOP/s or full bandwidth and nothing
between kernels. A step on a real GPU is slower by three things the HLO can count:

    t_step = a * roofline_s + c_launch * launches + c_sync * host_syncs

- `a` >= 1 in practice: kernels run below their roofline (cuBLAS and cuDNN reach a fraction of the
  nominal peak; on the H200 a plain 8192^3 bf16 product reached 54-69% of it), one factor for all
  kernels because six rows cannot tell per-kind factors apart (docs/plan.md, "The estimate, calibrated
  on measured steps");
- `c_launch`: the gap a kernel launch adds on the GPU's stream (the launches `hlo.count_kernels`
  counts as the GPU runs them);
- `c_sync`: each iteration of a loop without a known trip count copies its predicate to the host and
  waits for it (XLA's while thunk), so the GPU idles while the host decides and launches the next
  iteration; a conditional does the same once.

The coefficients are non-negative least squares (scipy.optimize.nnls, Lawson & Hanson) on the squared
*relative* error, each row divided by its measured time, so that a 30 ms row weighs as much as a 100 ms
one. The error stated with an estimate is the worst of two: leave-one-out (each row predicted by the
fit on the others) and leave-pair-out (each row predicted by the fit on the other shapes, its own
shape's two models left out, which is what planning a new shape asks of the fit). A calibration belongs to one target (its kernels, its launch latency); the others are
uncalibrated and say so. The data (rows, features, coefficients, errors) are in `calibrations/*.json`,
written by `benchmarks/plan_calibration.py` from the features stored in benchmarks/results/.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

import numpy as np
from scipy.optimize import nnls

from qkvflow.plan import hlo, roofline

FEATURES = ("roofline_s", "launches", "host_syncs")
"""The model's terms, in the order of its coefficients."""

DATA = Path(__file__).with_name("calibrations")


def features(text_or_module, target, unknown_trip_count: int = 1) -> dict:
    """A step's calibration features on `target` (a GPU target with rates), from its optimised HLO:
    the roofline's seconds in all and by kernel kind (`gemm`: kernels with matmul FLOPs other than
    attention; `attention`: cuDNN's fused attention; `other`: elementwise, reductions, copies;
    `collectives`), kernel launches and host synchronisations per step as `hlo.count_kernels` counts them."""
    module = hlo._module(text_or_module)
    peak = target.peak_flops["bfloat16"]
    rates = {"peak_flops": peak, "f32_peak_flops": target.peak_flops.get("float32"),
             "hbm_bytes_per_s": target.hbm_bytes_per_s}  # fmt: skip
    by_kind = {"gemm": 0.0, "attention": 0.0, "other": 0.0}
    for k in roofline.kernels(module, unknown_trip_count=unknown_trip_count, **rates):
        if k["collective"] is not None:
            continue
        target_name = (k["instr"].attr("custom_call_target") or "") if k["instr"].opcode == "custom-call" else ""
        kind = "attention" if "fmha" in target_name else "gemm" if k["flops"] else "other"
        by_kind[kind] += k["launches"] * k["seconds"]
    est = roofline.estimate(
        module, peak_flops=peak, f32_peak_flops=rates["f32_peak_flops"], hbm_bytes_per_s=target.hbm_bytes_per_s,
        link_bytes_per_s=target.link_bytes_per_s, network_bytes_per_s=target.network_bytes_per_s,
        devices_per_node=target.devices_per_node, unknown_trip_count=unknown_trip_count,
    )  # fmt: skip
    counts = hlo.count_kernels(module, unknown_trip_count=unknown_trip_count)
    return {
        "roofline_s": est["step_s"],
        "roofline_by_kind_s": {**by_kind, "collectives": est["collectives_s"]},
        "launches": counts["launches"],
        "host_syncs": counts.get("host_syncs", 0),
    }


def design(rows: list[dict], names=FEATURES) -> np.ndarray:
    """The rows' features as a matrix, one column per name."""
    return np.array([[float(r["features"][n]) for n in names] for r in rows])


def fit(rows: list[dict], names=FEATURES) -> dict:
    """Non-negative coefficients minimising sum((predicted - measured) / measured)^2 over `rows`
    (each a dict with `measured_s` and `features`)."""
    measured = np.array([r["measured_s"] for r in rows])
    coef, _ = nnls(design(rows, names) / measured[:, None], np.ones(len(rows)))
    return dict(zip(names, (float(c) for c in coef)))


def predict(coefficients: dict, feats: dict) -> float:
    """The calibrated step time in seconds."""
    return sum(c * float(feats[n]) for n, c in coefficients.items())


def leave_one_out(rows: list[dict], names=FEATURES) -> list[dict]:
    """Each row predicted by the fit on all the others: `predicted_s` and `error` (relative)."""
    return leave_out(rows, names, group=lambda i, row: i)


def leave_pair_out(rows: list[dict], names=FEATURES) -> list[dict]:
    """Each row predicted by the fit on the rows of the other pairs (a shape and batch left out with
    both its models: what a plan of a new shape is), as `leave_one_out`."""
    return leave_out(rows, names, group=lambda i, row: row["pair"])


def leave_out(rows: list[dict], names, group) -> list[dict]:
    out = []
    for i, row in enumerate(rows):
        left = group(i, row)
        coefficients = fit([r for j, r in enumerate(rows) if group(j, r) != left], names)
        predicted = predict(coefficients, row["features"])
        out.append({"name": row["name"], "predicted_s": predicted, "error": predicted / row["measured_s"] - 1})
    return out


def pair_ratios(rows: list[dict], predicted: list[float]) -> list[dict]:
    """For each `pair` shared by an `ode` and a `baseline` row: the measured and predicted ratio of
    their step times (DiffEqFormer over GPT-2) and the predicted minus the measured."""
    by_pair: dict = {}
    for row, p in zip(rows, predicted):
        by_pair.setdefault(row["pair"], {})[row["model"]] = (row["measured_s"], p)
    out = []
    for pair, m in by_pair.items():
        if {"ode", "baseline"} <= set(m):
            measured = m["ode"][0] / m["baseline"][0]
            predicted_ratio = m["ode"][1] / m["baseline"][1]
            out.append({"pair": pair, "measured": measured, "predicted": predicted_ratio,
                        "error": predicted_ratio - measured})  # fmt: skip
    return out


@cache
def for_target(name: str) -> dict | None:
    """The shipped calibration of target `name` (calibrations/<name>.json), None when it has none."""
    path = DATA / f"{name}.json"
    return json.loads(path.read_text()) if path.is_file() else None


def calibrated(estimate_feats: dict, target_name: str, model_flops=None, peak_flops=None) -> dict:
    """The plan's `calibrated` entry: the calibrated step time, its band (the rows' worst error when left
    out of the fit, alone or with their pair: the truth lies in [step / (1 + band), step / (1 - band)]
    if this step errs no more than they did), MFU on it, and the rows behind it; or
    `{"calibrated": False, "why": ...}`."""
    c = for_target(target_name)
    if c is None:
        return {"calibrated": False, "why": f"no measured {target_name} step to calibrate against"}
    if estimate_feats.get("roofline_s") is None:
        return {"calibrated": False, "why": "the roofline has no time for this step"}
    step_s = predict(c["coefficients"], estimate_feats)
    band = c["band"]
    mfu = model_flops / (step_s * peak_flops) if model_flops and peak_flops else None
    return {
        "calibrated": True,
        "step_s": step_s,
        "mfu": mfu,
        "low_s": step_s / (1 + band),
        "high_s": step_s / (1 - band),
        "band": band,
        "coefficients": c["coefficients"],
        "ratio_error": c["ratio_error"],
        "rows": [f"{r['name']} ({r['commit']}, {r['measured_s'] * 1e3:.1f} ms)" for r in c["rows"]],
        "source": c["source"],
        "scope": c["scope"],
    }
