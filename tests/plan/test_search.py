"""`qkvflow plan --search`: the layouts it enumerates, the batch search, the ranking, the compile cap, the
candidates it skips, and overrides that parse back into the layout.

Most tests drive `search.search` with a stand-in for `planner.plan` whose memory and time are simple
functions of the candidate's layout (stated in each test), so that the expected answer is worked out by
hand; one runs the verb on `cpu:2` with real compiles."""

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from qkvflow.errors import UserError
from qkvflow.plan import search, targets
from qkvflow.plan.config import PlanConfig
from qkvflow.runs import configfile
from qkvflow.training.sharding import mesh_shape
from tests.helpers import with_host_devices
from tests.timescale import limit

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "tests/configs/plan_tiny.yaml")
MEDIUM_ODE = str(ROOT / "configs/paper/owt_medium_ode.yaml")


@pytest.fixture(scope="module")
def tiny():
    """The one-layer GPT-2 of the plan tests at global batch 32 (gradient_checkpointing: true, Levanter's default)."""
    return configfile.parse(PlanConfig, ["--config_path", TINY, "--trainer.train_batch_size", "32"], "plan")


@pytest.fixture(scope="module")
def medium_ode():
    return configfile.parse(PlanConfig, ["--config_path", MEDIUM_ODE], "plan")


def test_the_layouts_are_every_divisor_mesh_with_fsdp_on_and_off_and_every_remat_choice(tiny):
    todo, skipped = search.layouts(8, tiny.model)
    got = [(lay.axes["data"], lay.axes["replica"], lay.axes["model"], lay.fsdp, lay.remat) for lay in todo]
    expected = [  # (data, replica, model, FSDP, gradient_checkpointing), by hand for 8 devices
        (8, 1, 1, True, True), (8, 1, 1, True, False), (1, 8, 1, False, True), (1, 8, 1, False, False),
        (4, 1, 2, True, True), (4, 1, 2, True, False), (1, 4, 2, False, True), (1, 4, 2, False, False),
        (2, 1, 4, True, True), (2, 1, 4, True, False), (1, 2, 4, False, True), (1, 2, 4, False, False),
        (1, 1, 8, True, True), (1, 1, 8, True, False),
    ]  # fmt: skip
    assert got == expected
    # one data-parallel device: FSDP off is the same program as on, so it is skipped, with that reason
    assert [(lay.axes, lay.fsdp, lay.remat) for lay, _ in skipped] == [
        ({"data": 1, "replica": 1, "model": 8}, False, True),
        ({"data": 1, "replica": 1, "model": 8}, False, False),
    ]
    assert all("same program" in why for _, why in skipped)
    assert [lay.model for lay in search.layouts(6, tiny.model, fsdp=(True,))[0]] == [1, 1, 2, 2, 3, 3, 6, 6]
    with pytest.raises(UserError, match="--search_model 3 does not divide --devices 8"):
        search.layouts(8, tiny.model, models=[3])


def test_remat_choices_are_the_keys_the_model_config_has(tiny, medium_ode):
    import dataclasses

    ode = medium_ode.model.ode  # num_steps 24, checkpoints 5: keep 5 states, or every step's (null)
    assert search.remat_key(medium_ode.model) == ("model.ode.checkpoints", [5, None])
    every = dataclasses.replace(medium_ode.model, ode=dataclasses.replace(ode, checkpoints=24))
    assert search.remat_key(every) == ("model.ode.checkpoints", [None])  # K = N is null's program
    assert [lay.remat for lay in search.layouts(1, medium_ode.model, remats=[24, None, 3])[0]] == [None, 3]
    backsolve = dataclasses.replace(medium_ode.model, ode=dataclasses.replace(ode, adjoint="backsolve"))
    assert search.remat_key(backsolve) == (None, [None])
    assert search.remat_key(tiny.model) == ("model.gradient_checkpointing", [True, False])
    off = dataclasses.replace(tiny.model, gradient_checkpointing=False)
    assert search.remat_key(off) == ("model.gradient_checkpointing", [False, True])


def test_the_per_device_batches_are_those_that_split_the_global_batch_into_whole_microbatches():
    assert search.batches(256, 8) == [1, 2, 4, 8, 16, 32]
    assert search.batches(256, 4) == [1, 2, 4, 8, 16, 32, 64]
    assert search.batches(24, 8) == [1, 3]
    assert search.batches(6, 4) == []


def fake_plan(memory, step_s, calls, arguments=lambda *key: 1000):
    """A stand-in for planner.plan: memory(data, replica, model, b, remat) bytes in all, arguments(...) of
    them the step's arguments, and step_s(...) seconds."""

    def plan(config, target, devices, vocab):
        t = config.trainer
        axes = dict(t.mesh.axes)
        key = (
            axes["data"],
            axes["replica"],
            axes["model"],
            t.per_device_parallelism,
            config.model.gradient_checkpointing,
        )
        calls.append(key)
        if axes["model"] == 8:
            raise UserError("the training step does not compile for cpu:8: IndivisibleError: heads over 8")
        total = memory(*key)
        return {
            "memory": {"total": total, "arguments": arguments(*key)},
            "fits": total <= target.memory_bytes,
            "estimate": {"step_s": step_s(*key)},
            "compile_s": 1.0,
        }

    return plan


def test_each_layout_gets_its_largest_fitting_batch_and_the_ranking_follows_the_estimate(tiny):
    # memory = 1000 (state) + 100 b (150 b without remat), twice that without FSDP; time = the layout's
    # seconds per microbatch x the microbatches (32 / (b x data-parallel devices)); model 8 does not compile
    def memory(data, replica, model, b, remat):
        return int((1000 + 100 * b * (1 if remat else 1.5)) * (1 if data > 1 or replica == 1 else 2))

    times = {  # seconds, by (data, replica, model, remat) at any batch
        (8, 1, 1, True): 5.0, (8, 1, 1, False): 4.0, (1, 8, 1, True): 7.0, (1, 8, 1, False): 6.0,
        (4, 1, 2, True): 3.0, (4, 1, 2, False): 8.0, (1, 4, 2, True): 1.0, (1, 4, 2, False): 2.0,
        (2, 1, 4, True): 9.0, (2, 1, 4, False): 0.5, (1, 2, 4, True): 10.0, (1, 2, 4, False): 11.0,
    }  # fmt: skip
    calls = []
    plan = fake_plan(memory, lambda d, r, m, b, remat: times[(d, r, m, remat)] * 32 / (b * d * r), calls)
    out = search.search(tiny, targets.get("cpu:8", device_memory=3000), 8, 64, max_compiles=100, plan_fn=plan)
    best = {(tuple(r["mesh"].values()), r["remat"]["model.gradient_checkpointing"]): r for r in out["ranked"]}
    # by hand: memory 1000 + 100 b (x1.5 without remat) <= 3000 with FSDP; 2 x that without
    largest = {
        ((8, 1, 1), True): 4, ((8, 1, 1), False): 4, ((1, 8, 1), True): 4, ((1, 8, 1), False): 2,
        ((4, 1, 2), True): 8, ((4, 1, 2), False): 8, ((1, 4, 2), True): 4, ((1, 4, 2), False): 2,
        ((2, 1, 4), True): 16, ((2, 1, 4), False): 8, ((1, 2, 4), True): 4, ((1, 2, 4), False): 2,
    }  # fmt: skip
    assert {k: r["per_device"] for k, r in best.items()} == largest
    assert all(r["largest_fitting_known"] and r["fits"] for r in out["ranked"])
    steps = [r["step_s"] for r in out["ranked"]]
    assert steps == sorted(steps) and len(steps) == 12
    # the fastest: model 4, FSDP, no remat at 8 per device (2 microbatches): 0.5 x 2 = 1.0 s
    assert out["ranked"][0]["mesh"] == {"data": 2, "replica": 1, "model": 4} and out["ranked"][0]["step_s"] == 1.0
    assert out["ranked"][0]["microbatches"] == 2
    assert out["compiles"] == len(calls)
    assert (
        "--trainer.per_device_parallelism 8 --model.gradient_checkpointing false"
        in search.text(out, TINY).splitlines()[-1]
    )


def test_the_batch_search_on_a_line_takes_the_compiles_counted_by_hand(tiny):
    # one layout; memory = 1000 + 100 b; valid 1, 2, 4, 8, 16, 32; limit 2000 -> 8 (1800) fits, 16 (2600) not.
    # 32 first (4200: over), the proportional guess from it and the state (1000 + 3200 b / 32) gives 10 -> 8
    # (fits), then 16, the only batch left between: 3 compiles
    calls = []
    plan = fake_plan(lambda d, r, m, b, remat: 1000 + 100 * b, lambda *_: 1.0, calls)
    out = search.search(
        tiny, targets.get("cpu:1", device_memory=2000), 1, 64, models=[1], fsdp=(True,), remats=[True], plan_fn=plan
    )
    assert [c[3] for c in calls] == [32, 8, 16]
    assert out["ranked"][0]["per_device"] == 8 and out["ranked"][0]["microbatches"] == 4
    assert [r["per_device"] for r in out["not_fitting"]] == [32, 16]
    # stopped by the cap after 32 and 8: 8 fits, 16 is not known not to
    calls.clear()
    out = search.search(
        tiny, targets.get("cpu:1", device_memory=2000), 1, 64, max_compiles=2, models=[1], fsdp=(True,),
        remats=[True], plan_fn=plan,
    )  # fmt: skip
    assert [c[3] for c in calls] == [32, 8] and not out["ranked"][0]["largest_fitting_known"]
    assert "8 (at least)" in search.text(out)
    # at 1050 nothing fits: 32, then 1 (1100), and the search of the layout is over
    calls.clear()
    limit = targets.get("cpu:1", device_memory=1050)
    out = search.search(tiny, limit, 1, 64, max_compiles=2, models=[1], fsdp=(True,), remats=[True], plan_fn=plan)
    assert [c[3] for c in calls] == [32, 1] and out["ranked"] == [] and out["not_compiled"] == []
    assert [r["per_device"] for r in out["not_fitting"]] == [32, 1]
    out = search.search(tiny, limit, 1, 64, max_compiles=1, models=[1], fsdp=(True,), remats=[True], plan_fn=plan)
    assert out["not_compiled"][0]["compiles"] == 1
    assert "not searched (the compile cap was reached after 1 compile with no batch that fits)" in search.text(out)


def test_a_layout_whose_arguments_alone_exceed_the_memory_stops_after_one_compile(tiny):
    # FSDP off holds the whole state: 4000 bytes of arguments (a lower bound of the total at every batch)
    calls = []

    def off(d, r, m, b, remat):
        return r > 1

    plan = fake_plan(
        lambda *k: (5000 if off(*k) else 1000) + 100 * k[3], lambda *_: 1.0, calls,
        arguments=lambda *k: 4000 if off(*k) else 1000,
    )  # fmt: skip
    out = search.search(tiny, targets.get("cpu:8", device_memory=3000), 8, 64, models=[1], remats=[True], plan_fn=plan)
    assert calls == [(8, 1, 1, 4, True), (1, 8, 1, 4, True)]
    assert out["skipped"] == [
        {
            "mesh": {"data": 1, "replica": 8, "model": 1},
            "fsdp": False,
            "remat": {"model.gradient_checkpointing": True},
            "why": "no per-device batch fits: the arguments alone (state and batch) take 3.91 KiB of 2.93 KiB usable",
        }
    ]


def test_the_compile_cap_is_honoured_and_reported(tiny):
    calls = []
    plan = fake_plan(lambda d, r, m, b, remat: 1000 + 100 * b, lambda *_: 1.0, calls)
    target = targets.get("cpu:8", device_memory=10**9)  # everything fits: one compile per layout
    out = search.search(tiny, target, 8, 64, max_compiles=3, plan_fn=plan)
    assert len(calls) == 3 and out["compiles"] == 3 and out["max_compiles"] == 3
    assert len(out["not_compiled"]) == 14 - 3
    assert out["not_compiled"][0] == {
        "mesh": {"data": 1, "replica": 8, "model": 1},
        "fsdp": False,
        "remat": {"model.gradient_checkpointing": False},
        "compiles": 0,
    }
    text = search.text(out, TINY)
    assert "3 compiles of at most 3 (--search_max_compiles)" in text
    assert text.count("not searched (the compile cap was reached): ") == 11
    with pytest.raises(UserError, match="--search_max_compiles 0 is invalid"):
        search.search(tiny, target, 8, 64, max_compiles=0, plan_fn=plan)


def test_invalid_candidates_are_skipped_with_their_reason(tiny):
    import dataclasses

    calls = []
    plan = fake_plan(lambda d, r, m, b, remat: 1000 + 100 * b, lambda *_: 1.0, calls)
    six = dataclasses.replace(tiny, trainer=dataclasses.replace(tiny.trainer, train_batch_size=6))
    out = search.search(six, targets.get("cpu:8", device_memory=10**9), 8, 64, remats=[True], plan_fn=plan)
    why = {(tuple(s["mesh"].values()), s["fsdp"]): s["why"] for s in out["skipped"]}
    assert why == {
        ((8, 1, 1), True): "trainer.train_batch_size=6 does not divide over 8 data-parallel devices",
        ((1, 8, 1), False): "trainer.train_batch_size=6 does not divide over 8 data-parallel devices",
        ((4, 1, 2), True): "trainer.train_batch_size=6 does not divide over 4 data-parallel devices",
        ((1, 4, 2), False): "trainer.train_batch_size=6 does not divide over 4 data-parallel devices",
        ((1, 1, 8), False): "FSDP off is FSDP on with one data-parallel device: the same program",
        ((1, 1, 8), True): "the training step does not compile for cpu:8: IndivisibleError: heads over 8",
    }
    # model 4 (batch 6 over 2: 3 per device fits) and model 8's refused compile: 3 attempts in all
    assert [(c[0], c[1], c[2], c[3]) for c in calls] == [(2, 1, 4, 3), (1, 2, 4, 3), (1, 1, 8, 6)]
    assert out["compiles"] == 3 and len(out["ranked"]) == 2


@pytest.mark.parametrize(
    "layout, per_device",
    [
        (search.Layout(4, 2, True, True), 16),
        (search.Layout(4, 2, False, False), 2),
        (search.Layout(8, 1, True, True), 32),
        (search.Layout(1, 8, True, False), 1),
    ],
)
def test_the_printed_overrides_parse_back_into_the_same_layout(tiny, layout, per_device):
    key, _ = search.remat_key(tiny.model)
    line = search.overrides(layout, per_device, key)
    config = configfile.parse(PlanConfig, ["--config_path", TINY, *shlex.split(line)], "plan")
    shape = mesh_shape(config.trainer.mesh, 8)
    assert (shape["data"], shape["replica"], shape["model"]) == (
        layout.data_parallel if layout.fsdp else 1,
        1 if layout.fsdp else layout.data_parallel,
        layout.model,
    )
    assert config.trainer.per_device_parallelism == per_device
    assert config.model.gradient_checkpointing is layout.remat
    assert config.trainer.mesh.param_mapping == {"embed": "data"}  # FSDP is the data axis's, not a new mapping


def test_an_ode_remat_override_parses_back(medium_ode):
    for value in (5, None):
        line = search.overrides(search.Layout(8, 1, True, value), 16, "model.ode.checkpoints")
        config = configfile.parse(PlanConfig, ["--config_path", MEDIUM_ODE, *shlex.split(line)], "plan")
        assert config.model.ode.checkpoints == value and config.trainer.per_device_parallelism == 16


def test_search_flags_are_read_and_bad_ones_refused_in_one_line(tiny, medium_ode):
    from qkvflow.cli.plan import parser

    args, _ = parser().parse_known_args(["--target", "cpu:4", "--search", "--search_model", "1,2"])
    got = search.options(args, tiny)
    assert (got["max_compiles"], got["models"], got["fsdp"], got["remats"]) == (12, [1, 2], (True, False), None)
    args, _ = parser().parse_known_args(["--target", "x", "--search_fsdp", "off", "--search_remat", "null,5"])
    assert search.options(args, medium_ode)["remats"] == [None, 5] and search.options(args, medium_ode)["fsdp"] == (
        False,
    )
    for flag, value, message in [
        ("--search_model", "1,two", "--search_model '1,two' is invalid: expected sizes such as 1,2,4"),
        ("--search_fsdp", "maybe", "--search_fsdp 'maybe' is invalid: expected on, off or on,off"),
        ("--search_remat", "0", "--search_remat '0' is invalid for model.ode.checkpoints: expected null or an"),
        ("--save_hlo", "x.txt", "--save_hlo is for one plan: --search finds each layout's largest batch itself"),
    ]:
        args, _ = parser().parse_known_args(["--target", "x", flag, value])
        with pytest.raises(UserError, match=message):
            search.options(args, medium_ode)


def test_the_verb_searches_on_two_cpu_devices_with_real_compiles():
    env = {**os.environ, "XLA_FLAGS": with_host_devices(2)}
    cmd = [sys.executable, "-m", "qkvflow", "plan", "--config_path", TINY, "--target", "cpu:2", "--search"]
    cmd += ["--search_model", "1", "--search_remat", "true", "--search_max_compiles", "1", "--json"]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=limit(900))
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout)
    assert out["compiles"] == 1 and done.stderr.count("search: compile 1/1: ") == 1
    (best,) = out["ranked"]  # batch 4 over 2 devices: 2 per device, no accumulation, fits 16 GiB
    assert (best["mesh"], best["per_device"], best["microbatches"], best["fits"]) == (
        {"data": 2, "replica": 1, "model": 1},
        2,
        1,
        True,
    )
    assert out["not_compiled"] == [
        {
            "mesh": {"data": 1, "replica": 2, "model": 1},
            "fsdp": False,
            "remat": {"model.gradient_checkpointing": True},
            "compiles": 0,
        }
    ]
    config = configfile.parse(PlanConfig, ["--config_path", TINY, *shlex.split(best["overrides"])], "plan")
    assert mesh_shape(config.trainer.mesh, 2) == {"data": 2, "replica": 1, "model": 1, "replica_dcn": 1}


def test_the_ranking_takes_the_calibrated_estimate_and_its_band_where_the_plan_has_one(tiny):
    calibrated = {"calibrated": True, "step_s": 2.0, "band": 0.12, "mfu": 0.3, "rows": ["a", "b", "c"]}
    plan = {"estimate": {"step_s": 1.0, "mfu": 0.6, "calibrated": calibrated}}
    assert search.estimate(plan) == {"step_s": 2.0, "error": 0.12, "mfu": 0.3, "is": "calibrated on 3 measured steps"}
    plan = {"estimate": {"step_s": 1.0, "mfu": 0.6, "calibrated": {"calibrated": False, "why": "no measured X"}}}
    assert search.estimate(plan) == {
        "step_s": 1.0,
        "error": None,
        "mfu": 0.6,
        "is": "the roofline, not calibrated (no measured X)",
    }
    # the roofline says FSDP off is faster, the calibration says on: the calibration ranks
    calls = []
    uncalibrated = fake_plan(lambda *k: 1000, lambda d, r, m, b, remat: 1.0 if r > 1 else 2.0, calls)

    def plan_fn(config, target, devices, vocab):
        p = uncalibrated(config, target, devices, vocab)
        off = config.trainer.mesh.axes["replica"] > 1
        p["estimate"]["calibrated"] = {"calibrated": True, "step_s": 5.0 if off else 4.0, "band": 0.1, "mfu": None}
        p["estimate"]["calibrated"]["rows"] = ["h200 row"]
        return p

    out = search.search(
        tiny, targets.get("cpu:8", device_memory=10**6), 8, 64, models=[1], remats=[True], plan_fn=plan_fn
    )
    assert [(r["fsdp"], r["step_s"], r["error"]) for r in out["ranked"]] == [(True, 4.0, 0.1), (False, 5.0, 0.1)]
    assert "+-10%" in search.text(out)


def test_the_verb_refuses_a_bad_search_flag_in_one_line(capsys):
    import jax

    from qkvflow.cli import main

    jax.devices()  # this process's backend, as the rest of the suite has it: one CPU device
    rc = main(["plan", "--config_path", TINY, "--target", "cpu:1", "--search", "--search_model", "2"])
    out, err = capsys.readouterr()
    assert (rc, out) == (2, "") and err == "qkvflow plan: error: --search_model 2 does not divide --devices 1\n"
