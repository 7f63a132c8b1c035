"""The step-time calibration: its fit, its leave-one-out error, its features and how the plan prints it.

References are built here from the model's equation (t = a roofline + c launches + s syncs) and from
least-squares sums written out by hand, never from the code under test.
"""

import json
from pathlib import Path

import numpy as np
import pytest

from qkvflow.plan import calibration, report, targets

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks/results/2026-11-29_plan_calibration"


def row(name, measured, **feats):
    return {"name": name, "measured_s": measured, "features": feats}


def test_the_fit_recovers_the_coefficients_the_rows_were_made_with():
    a, c, s = 1.37, 3.1e-6, 1.1e-4
    rng = np.random.default_rng(0)
    rows = []
    for i in range(6):
        f = {
            "roofline_s": rng.uniform(0.01, 0.1),
            "launches": rng.integers(1000, 3000),
            "host_syncs": rng.integers(0, 60),
        }
        rows.append(row(f"r{i}", a * f["roofline_s"] + c * f["launches"] + s * f["host_syncs"], **f))
    coef = calibration.fit(rows)
    assert list(coef) == ["roofline_s", "launches", "host_syncs"]
    assert coef["roofline_s"] == pytest.approx(a, rel=1e-9)
    assert coef["launches"] == pytest.approx(c, rel=1e-6)
    assert coef["host_syncs"] == pytest.approx(s, rel=1e-6)
    for r in calibration.leave_one_out(rows):  # an exact model predicts every left-out row
        assert r["error"] == pytest.approx(0, abs=1e-9)


def test_a_coefficient_the_data_would_make_negative_is_zero_and_the_rest_refit():
    # t = 2 x - 0.5 y: unconstrained least squares would find y's -0.5; a cost cannot be negative, so y's
    # coefficient is 0 and x's is the one-feature least squares of the relative error,
    # argmin_c sum (c x_i / t_i - 1)^2 = sum(x_i / t_i) / sum((x_i / t_i)^2)
    xs, ys = [1.0, 2.0, 3.0, 4.0], [1.0, 0.0, 2.0, 1.0]
    rows = [row(f"r{i}", 2 * x - 0.5 * y, x=x, y=y) for i, (x, y) in enumerate(zip(xs, ys))]
    q = [x / (2 * x - 0.5 * y) for x, y in zip(xs, ys)]
    coef = calibration.fit(rows, ("x", "y"))
    assert coef["y"] == 0
    assert coef["x"] == pytest.approx(sum(q) / sum(v * v for v in q), rel=1e-12)


def test_leave_one_out_predicts_each_row_from_the_others_fit():
    # one feature: the fit on rows j != i is c_i = sum(q_j) / sum(q_j^2), q_j = x_j / t_j
    rows = [row("a", 2.0, x=1.0), row("b", 3.0, x=2.0), row("c", 10.0, x=4.0)]
    loo = calibration.leave_one_out(rows, ("x",))
    # left out a: q = 2/3, 4/10 -> c = (2/3 + 0.4) / (4/9 + 0.16) = (16/15) / (136/225) = 30/17
    assert loo[0]["predicted_s"] == pytest.approx(30 / 17 * 1.0, rel=1e-12)
    assert loo[0]["error"] == pytest.approx(30 / 17 / 2.0 - 1, rel=1e-12)
    # left out b: q = 1/2, 4/10 -> c = 0.9 / 0.41 = 90/41
    assert loo[1]["predicted_s"] == pytest.approx(90 / 41 * 2.0, rel=1e-12)
    # left out c: q = 1/2, 2/3 -> c = (7/6) / (1/4 + 4/9) = (7/6) / (25/36) = 42/25
    assert loo[2]["predicted_s"] == pytest.approx(42 / 25 * 4.0, rel=1e-12)
    assert loo[2]["error"] == pytest.approx(42 / 25 * 4.0 / 10.0 - 1, rel=1e-12)


def test_leave_pair_out_predicts_both_rows_of_a_pair_from_the_other_pairs_fit():
    # one feature, q = x / t: pair p (q = 1/2, 1/4) and pair s (q = 2/3, 1/3). Left out p, the fit on s is
    # c = (2/3 + 1/3) / (4/9 + 1/9) = 9/5; left out s, the fit on p is c = (3/4) / (1/4 + 1/16) = 12/5
    rows = [
        {**row("p1", 2.0, x=1.0), "pair": "p"},
        {**row("s1", 3.0, x=2.0), "pair": "s"},
        {**row("p2", 4.0, x=1.0), "pair": "p"},
        {**row("s2", 3.0, x=1.0), "pair": "s"},
    ]
    lpo = calibration.leave_pair_out(rows, ("x",))
    assert [r["predicted_s"] for r in lpo] == pytest.approx([9 / 5, 12 / 5 * 2.0, 9 / 5, 12 / 5], rel=1e-12)
    assert lpo[1]["error"] == pytest.approx(12 / 5 * 2.0 / 3.0 - 1, rel=1e-12)


def test_pair_ratios_divide_the_ode_row_by_its_baseline():
    rows = [
        {"pair": "p", "model": "ode", "measured_s": 3.0},
        {"pair": "p", "model": "baseline", "measured_s": 2.0},
        {"pair": "q", "model": "ode", "measured_s": 1.0},  # no baseline: no ratio
    ]
    (r,) = calibration.pair_ratios(rows, [2.6, 2.0, 9.9])
    assert r["pair"] == "p" and r["measured"] == 1.5 and r["predicted"] == pytest.approx(1.3)
    assert r["error"] == pytest.approx(1.3 - 1.5)


HLO = """HloModule m

%ew (x: f32[1024,1024]) -> f32[1024,1024] {
  %x = f32[1024,1024]{1,0} parameter(0)
  ROOT %m = f32[1024,1024]{1,0} multiply(%x, %x)
}

%ew1 (z: f32[256]) -> f32[256] {
  %z = f32[256]{0} parameter(0)
  ROOT %z2 = f32[256]{0} multiply(%z, %z)
}

%lbody (s: (s32[], f32[256])) -> (s32[], f32[256]) {
  %s = (s32[], f32[256]{0}) parameter(0)
  %c = s32[] get-tuple-element(%s), index=0
  %y = f32[256]{0} get-tuple-element(%s), index=1
  %y2 = f32[256]{0} fusion(%y), kind=kLoop, calls=%ew1
  ROOT %r = (s32[], f32[256]{0}) tuple(%c, %y2)
}

%lcond (s.1: (s32[], f32[256])) -> pred[] {
  %s.1 = (s32[], f32[256]{0}) parameter(0)
  %c.1 = s32[] get-tuple-element(%s.1), index=0
  %lim = s32[] constant(5)
  ROOT %lt = pred[] compare(%c.1, %lim), direction=LT
}

ENTRY %main (a: bf16[4096,4096], b: bf16[4096,4096], x: f32[1024,1024], q: bf16[2,128,4,64], k: bf16[2,256,4,64], v: bf16[2,256,4,64], st: (s32[], f32[256])) -> f32[1024,1024] {
  %a = bf16[4096,4096]{1,0} parameter(0)
  %b = bf16[4096,4096]{1,0} parameter(1)
  %x.0 = f32[1024,1024]{1,0} parameter(2)
  %q = bf16[2,128,4,64]{3,2,1,0} parameter(3)
  %k = bf16[2,256,4,64]{3,2,1,0} parameter(4)
  %v = bf16[2,256,4,64]{3,2,1,0} parameter(5)
  %st = (s32[], f32[256]{0}) parameter(6)
  %w = (s32[], f32[256]{0}) while(%st), condition=%lcond, body=%lbody
  %g = (bf16[4096,4096]{1,0}, s8[4]{0}) custom-call(%a, %b), custom_call_target="__cublas$lt$matmul", backend_config={"gemm_backend_config":{"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["0"]}}}
  %o = (bf16[2,128,4,64]{3,2,1,0}, u8[0]{0}) custom-call(%q, %k, %v), custom_call_target="__cudnn$fmhaSoftmax", backend_config={"cudnn_fmha_backend_config":{"mask_type":"NO_MASK"}}
  ROOT %e = f32[1024,1024]{1,0} fusion(%x.0), kind=kLoop, calls=%ew
}
"""


def test_features_split_the_roofline_by_kernel_kind():
    t = targets.get("H200")
    P, W = t.peak_flops["bfloat16"], t.hbm_bytes_per_s
    gemm = max(2 * 4096**3 / P, (3 * 4096 * 4096 * 2 + 4) / W)
    attention_flops = 2 * (2 * 2 * 4 * 128 * 256 * 64)  # QK^T and PV, no mask
    attention_bytes = (2 * 128 * 4 * 64 + 2 * 2 * 256 * 4 * 64) * 2 + 2 * 128 * 4 * 64 * 2
    attention = max(attention_flops / P, attention_bytes / W)
    # the loop XLA has no trip count for, taken to run 4 times: its body's fusion 4 times, its condition
    # (a compare of two s32 scalars into a pred) 5 times, each followed by a host synchronisation
    other = (2 * 1024 * 1024 * 4 + 4 * 2 * 256 * 4 + 5 * (4 + 4 + 1)) / W
    f = calibration.features(HLO, t, unknown_trip_count=4)
    k = f["roofline_by_kind_s"]
    assert k["gemm"] == pytest.approx(gemm, rel=1e-12)
    assert k["attention"] == pytest.approx(attention, rel=1e-12)
    assert k["other"] == pytest.approx(other, rel=1e-12) and k["collectives"] == 0
    assert f["roofline_s"] == pytest.approx(gemm + attention + other, rel=1e-12)
    assert f["launches"] == 3 + 4 + 5 and f["host_syncs"] == 5


SHIPPED = calibration.for_target("H200")


def test_the_shipped_h200_calibration_is_the_fit_of_its_own_rows():
    rows = SHIPPED["rows"]
    assert len(rows) >= 6 and {r["model"] for r in rows} == {"ode", "baseline"}
    coef = calibration.fit(rows)
    for name in calibration.FEATURES:
        assert coef[name] == pytest.approx(SHIPPED["coefficients"][name], rel=1e-9, abs=1e-15)
    loo, lpo = calibration.leave_one_out(rows), calibration.leave_pair_out(rows)
    for r, o, q in zip(rows, loo, lpo):
        assert r["loo_error"] == pytest.approx(o["error"], rel=1e-9, abs=1e-12)
        assert r["lpo_error"] == pytest.approx(q["error"], rel=1e-9, abs=1e-12)
    assert SHIPPED["band"] == pytest.approx(max(abs(o["error"]) for o in loo + lpo), abs=1e-4)


def test_the_shipped_rows_are_the_measured_device_runs():
    """Each row's measured time is the median of the device's speed JSON that rows.json names."""
    spec = {(r["name"], r["commit"]): r for r in json.loads((RESULTS / "rows.json").read_text())["rows"]}
    for r in SHIPPED["rows"]:
        source = spec[(r["name"], r["commit"])]
        data = json.loads((ROOT / source["measured_json"]).read_text())
        (run,) = [x for x in data.get("runs", [data]) if x["config"]["batch"] == r["batch"]]
        assert run["device"]["kind"] == "NVIDIA H200"
        assert r["measured_s"] == run[r["model"]]["step_time_s"]["median"]


def test_the_shipped_features_are_what_the_counters_read_from_the_shipped_hlo():
    """A change to the HLO counters or the roofline changes the features: refit then (the README's commands)."""
    import gzip

    from qkvflow.plan import hlo

    stored = {(r["name"], r["commit"]): r for r in json.loads((RESULTS / "features.json").read_text())["rows"]}
    for r in SHIPPED["rows"]:
        tag = f"{Path(r['config']).stem}_b{r['batch']}_{r['model']}"
        text = gzip.decompress((RESULTS / "hlo" / r["commit"] / f"{tag}.hlo.txt.gz").read_bytes()).decode()
        trips = stored[(r["name"], r["commit"])]["ode_num_steps"] or 1
        f = calibration.features(hlo.parse(text), targets.get("H200"), unknown_trip_count=trips)
        assert f["launches"] == r["features"]["launches"] and f["host_syncs"] == r["features"]["host_syncs"]
        assert f["roofline_s"] == pytest.approx(r["features"]["roofline_s"], rel=1e-9)


def plan_dict(target: str) -> dict:
    """A plan as `planner.plan` returns it, written out by hand (nothing compiled)."""
    feats = {"roofline_s": 0.02, "launches": 1500, "host_syncs": 27}
    e = {"step_s": 0.02, "kernels_s": 0.02, "compute_s": 0.01, "memory_s": 0.015, "collectives_s": 0.0,
         "mfu": 0.35, "model_flops": 7.0e12, "hlo_flops": 7.5e12, "unknown_trip_counts_taken_as": 12}  # fmt: skip
    peak = targets.get(target).peak_flops["bfloat16"]
    e["calibrated"] = calibration.calibrated(feats, target, e["model_flops"], peak)
    return {
        "target": target, "platform": targets.get(target).platform, "devices": 1, "mesh": {"data": 1}, "model_type": "DiffEqFormerGpt2Config",
        "batch": {"global": 8, "per_device": 8, "seq_len": 1024}, "compute_dtype": "bfloat16",
        "memory": {"parameters": 1, "optimizer_state": 1, "batch": 1, "temporaries": 1, "gradients": 1,
                   "total": 5, "usable": 10, "usable_is": "all"},
        "fits": True, "attention": {"config": "cudnn", "kernels": ["__cudnn$fmhaSoftmax"]},
        "kernels": {"launches": 1500, "static": 900, "fusions": 400, "once_per_step": 200,
                    "unknown_trip_counts": 2, "host_syncs": 27,
                    "host_syncs_by": {"while": 26, "conditional": 1}},
        "collectives": {}, "estimate": e, "compile_s": 1.0,
    }  # fmt: skip


def test_the_h200_plan_prints_the_calibrated_time_its_band_and_its_rows():
    p = plan_dict("H200")
    c = p["estimate"]["calibrated"]
    k = SHIPPED["coefficients"]
    step = k["roofline_s"] * 0.02 + k["launches"] * 1500 + k["host_syncs"] * 27
    assert c["calibrated"] and c["step_s"] == pytest.approx(step, rel=1e-12)
    assert c["low_s"] == pytest.approx(step / (1 + SHIPPED["band"])) and c["high_s"] == pytest.approx(
        step / (1 - SHIPPED["band"])
    )
    assert c["mfu"] == pytest.approx(7.0e12 / (step * 989.4e12), rel=1e-12)
    out = report.text(p)
    assert f"CALIBRATED on {len(SHIPPED['rows'])} measured H200 steps" in out
    assert f"step time {step * 1e3:,.1f} ms" in out
    for r in SHIPPED["rows"]:
        assert f"{r['name']} ({r['commit']}, {r['measured_s'] * 1e3:.1f} ms)" in out
    assert "NOT CALIBRATED" not in out


@pytest.mark.parametrize("target", ["H100-80GB", "A100-80GB"])
def test_a_target_without_measured_steps_says_it_is_not_calibrated(target):
    p = plan_dict(target)
    assert p["estimate"]["calibrated"]["calibrated"] is False
    out = report.text(p)
    assert f"NOT CALIBRATED for {target}" in out and "CALIBRATED on" not in out
    assert (
        json.loads(json.dumps(p))["estimate"]["calibrated"]["why"] == f"no measured {target} step to calibrate against"
    )


def test_the_planner_calibrates_its_own_roofline_launches_and_syncs():
    from qkvflow.plan import planner

    p = plan_dict("H200")
    p["estimate"]["step_s"], p["kernels"]["launches"], p["kernels"]["host_syncs"] = 0.05, 2000, 51
    k = SHIPPED["coefficients"]
    c = planner.calibrated_estimate(p, targets.get("H200"))
    assert c["step_s"] == pytest.approx(k["roofline_s"] * 0.05 + k["launches"] * 2000 + k["host_syncs"] * 51, rel=1e-12)
    assert planner.calibrated_estimate(p, targets.get("H100-80GB"))["calibrated"] is False
    p["estimate"]["step_s"] = None  # a TPU plan has no roofline time: nothing to calibrate
    assert planner.calibrated_estimate(p, targets.get("H200")) == {
        "calibrated": False,
        "why": "the roofline has no time for this step",
    }
