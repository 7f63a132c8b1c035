"""The parts of a plan that need no compile: targets, topologies, usable memory, the batch search."""

import pytest

from qkvflow.errors import UserError
from qkvflow.plan import backend, planner, step, targets


def test_targets_are_found_by_name_and_an_unknown_one_is_refused_with_the_list():
    assert targets.get("h100-80gb").name == "H100-80GB"
    assert targets.get("H200").memory_bytes == 150_000_000_000
    assert targets.get("cpu:4").name == "cpu:4" and targets.cpu_devices(targets.get("cpu:4")) == 4
    assert targets.get("A100-80GB", device_memory=123).memory_bytes == 123
    with pytest.raises(
        UserError, match=r"--target 'H300' is unknown: expected one of H100-80GB, H200, A100-80GB, v5e, v5p, cpu:N"
    ):
        targets.get("H300")


@pytest.mark.parametrize("name", sorted(n for n, t in targets.TARGETS.items() if t.platform == "gpu"))
def test_every_gpu_target_ships_its_spec_with_its_memory(name):
    target = targets.TARGETS[name]
    text = target.spec_text()
    assert text.startswith("# ") and "openxla/xla" in text.splitlines()[0] + text.splitlines()[1]
    assert f"device_memory_size: {target.memory_bytes}" in text
    assert f"memory_bandwidth: {int(target.hbm_bytes_per_s)}" in text


def test_a_gpu_target_is_read_from_a_spec_file_outside_the_package(tmp_path):
    spec = tmp_path / "mine.txtpb"
    spec.write_text("gpu_device_info {\n  core_count: 132\n  device_memory_size: 12345\n}\n")
    target = targets.from_spec_file(str(spec))
    assert (target.platform, target.memory_bytes, target.peak_flops) == ("gpu", 12345, {})
    assert target.spec_text() == spec.read_text()
    (tmp_path / "bad.txtpb").write_text("gpu_device_info { core_count: 132 }\n")
    with pytest.raises(UserError, match=r"bad.txtpb: no device_memory_size; expected an XLA GpuTargetConfigProto"):
        targets.from_spec_file(str(tmp_path / "bad.txtpb"))
    with pytest.raises(UserError, match=r"absent.txtpb: cannot read it"):
        targets.from_spec_file(str(tmp_path / "absent.txtpb"))


def test_topologies_put_eight_gpus_on_a_node():
    assert backend.topology_string(1, 8) == "1x1x1"
    assert backend.topology_string(8, 8) == "1x1x8"
    assert backend.topology_string(16, 8) == "1x2x8"
    with pytest.raises(UserError, match="not a whole number of 8-device nodes"):
        backend.topology_string(12, 8)


def test_tpu_slices_are_named_as_libtpu_names_them():
    assert [backend.tpu_grid(n, "v5p") for n in (1, 4, 8, 16)] == ["1x1x1", "2x2x1", "2x2x2", "2x2x4"]
    assert [backend.tpu_grid(n, "v5e") for n in (1, 4, 8)] == ["1x1", "2x2", "2x4"]
    with pytest.raises(UserError, match="a TPU slice has a power-of-two number of chips"):
        backend.tpu_grid(6, "v5p")


def test_a_gpu_may_use_the_fraction_jax_preallocates(monkeypatch):
    gpu = targets.get("H100-80GB")
    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
    assert planner.usable_memory(gpu)[0] == int(0.75 * 84_978_434_048)
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", ".9")
    assert planner.usable_memory(gpu)[0] == int(0.9 * 84_978_434_048)
    assert planner.usable_memory(targets.get("cpu:1", device_memory=1000))[0] == 1000
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "most")
    with pytest.raises(UserError, match="XLA_PYTHON_CLIENT_MEM_FRACTION='most' is invalid"):
        planner.usable_memory(gpu)


def test_the_batch_splits_over_the_data_parallel_axes():
    assert step.data_parallel({"data": 4, "replica": 2, "model": 2, "replica_dcn": 1}) == 8


def brute_force(total, limit):
    b = 0
    while total(b + 1) <= limit:
        b += 1
    return b


@pytest.mark.parametrize(
    "total, start, limit",
    [
        (lambda b: 100 + 10 * b, 8, 555),  # linear: found from the line in a few compiles
        (lambda b: 100 + 10 * b + b * b // 10, 8, 2000),  # curved: the line overshoots, bisection ends it
        (lambda b: 100 + 10 * b, 64, 555),  # the start does not fit
        (lambda b: 1000 + 10 * b, 8, 555),  # nothing fits
        (lambda b: 100 + 10 * b, 8, 100 + 10 * 8),  # the start is the answer
        (lambda b: 100 if b <= 5 else 1000, 1, 500),  # a step: no line helps, bisection must close the gap
    ],
)
def test_the_largest_batch_that_fits_is_found(total, start, limit):
    calls = []
    found = planner.largest_fitting(lambda b: calls.append(b) or total(b), start, limit)
    assert found["per_device"] == brute_force(total, limit) and found["exact"]
    assert found["compiles"] == len(calls) <= planner.MAX_COMPILES
    assert len(set(calls)) == len(calls)  # no batch compiled twice


def test_the_batch_search_stops_at_its_compile_limit():
    found = planner.largest_fitting(lambda b: b * b, 1, 10**9, max_compiles=3)
    # 1 and 2 fit; the line through them (slope 3) guesses far beyond, which does not fit: 3 compiles
    assert found == {"per_device": 2, "compiles": 3, "exact": False}


def test_the_plan_searches_per_device_batches_and_compiles_global_ones(monkeypatch):
    """planner.plan with --max_batch, its compiles replaced by a step whose memory is 1000 + 10 b bytes
    for a global batch b: on 4 data-parallel devices the largest per-device batch under 2000 is 25."""
    import types

    from qkvflow.plan import step as step_module

    hlo_text = "HloModule m\n\nENTRY %main (a: f32[4]) -> f32[4] {\n  ROOT %a = f32[4]{0} parameter(0)\n}\n"
    compiled_batches = []

    def fake_compile(config, target, devices, vocab, batch=None):
        batch = batch or 8
        compiled_batches.append(batch)
        stats = types.SimpleNamespace(
            argument_size_in_bytes=1000, output_size_in_bytes=0, alias_size_in_bytes=0, temp_size_in_bytes=10 * batch
        )
        executable = types.SimpleNamespace(memory_analysis=lambda: stats, as_text=lambda: hlo_text)
        return step_module.Compiled(executable, 0.0, {"data": 4, "model": 1}, 64, batch, "xla", "float32", 1, 2, 3, 1)

    monkeypatch.setattr(step_module, "compile_step", fake_compile)
    monkeypatch.setattr(backend, "devices_for", lambda target, n, slices=1: list(range(n)))
    config = types.SimpleNamespace(model=types.SimpleNamespace(max_seq_len=32, ode=None))
    monkeypatch.setattr(planner, "model_flops_per_device", lambda *a: 1.0)
    target = targets.get("cpu:4", device_memory=2000)
    out = planner.plan(config, target, 4, 64, search_max_batch=True)
    assert out["batch"]["per_device"] == 2 and out["memory"]["total"] == 1080
    assert out["max_batch"]["per_device"] == 25 and out["max_batch"]["global"] == 100
    assert all(b % 4 == 0 for b in compiled_batches)  # every compile is of a whole global batch


# --- a plan's parts with the compile replaced: what the planner does with what XLA gives it ---

LOOP_HLO = """HloModule m, num_partitions=4

%k (x: f32[8]) -> f32[8] {
  %x = f32[8]{0} parameter(0)
  ROOT %n = f32[8]{0} negate(%x)
}

%body (t: (s32[], f32[8])) -> (s32[], f32[8]) {
  %t = (s32[], f32[8]{0}) parameter(0)
  %v = f32[8]{0} get-tuple-element(%t), index=1
  %f = f32[8]{0} fusion(%v), kind=kLoop, calls=%k
  %i = s32[] get-tuple-element(%t), index=0
  ROOT %r = (s32[], f32[8]{0}) tuple(%i, %f)
}

%cond (c: (s32[], f32[8])) -> pred[] {
  %c = (s32[], f32[8]{0}) parameter(0)
  ROOT %p = pred[] fusion(%c), kind=kLoop, calls=%k
}

ENTRY %main (e: (s32[], f32[8])) -> (s32[], f32[8]) {
  %e = (s32[], f32[8]{0}) parameter(0)
  ROOT %w = (s32[], f32[8]{0}) while(%e), condition=%cond, body=%body
}
"""
"""One loop without a known trip count (a diffrax solve's kind): 1 kernel in its body, 1 in its condition."""


def fake_plan(monkeypatch, target, *, mesh=None, total=1000, model=None, batch=8, env=None, nodes=()):
    """planner.plan with the compile replaced by a step of `total` bytes on `mesh`, HLO `LOOP_HLO`."""
    import types

    from qkvflow.plan import step as step_module

    mesh = mesh or {"data": 4, "model": 1}

    def fake_compile(config, target, devices, vocab, batch=None):
        stats = types.SimpleNamespace(
            argument_size_in_bytes=total, output_size_in_bytes=0, alias_size_in_bytes=0, temp_size_in_bytes=0
        )
        executable = types.SimpleNamespace(memory_analysis=lambda: stats, as_text=lambda: LOOP_HLO)
        return step_module.Compiled(executable, 12.5, mesh, 64, batch or 8, "xla", "bfloat16", 1, 2, 3, 1, nodes)

    monkeypatch.setattr(step_module, "compile_step", fake_compile)
    monkeypatch.setattr(backend, "devices_for", lambda target, n, slices=1: list(range(n)))
    monkeypatch.setattr(planner, "model_flops_per_device", lambda *a: 1.0)
    for key, value in (env or {}).items():
        monkeypatch.setenv(key, value)
    config = types.SimpleNamespace(model=model or types.SimpleNamespace(max_seq_len=32, ode=None))
    return planner.plan(config, target, 4, 64)


def test_fits_uses_the_memory_fraction_jax_is_given(monkeypatch):
    # 0.75 x 84,978,434,048 = 63,733,825,536 bytes; 0.9 x = 76,480,590,643
    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
    needs = 70_000_000_000
    assert not fake_plan(monkeypatch, targets.get("H100-80GB"), total=needs)["fits"]
    plan = fake_plan(monkeypatch, targets.get("H100-80GB"), total=needs, env={"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.9"})
    assert plan["fits"] and plan["memory"]["usable"] == 76_480_590_643


def test_a_tpu_may_use_all_of_its_hbm_whatever_the_gpu_fraction_says(monkeypatch):
    v5p = targets.get("v5p")
    assert planner.TPU_MEM_FRACTION == 1.0
    for fraction in (None, "0.5"):
        if fraction:
            monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", fraction)
        assert planner.usable_memory(v5p)[0] == 95 * 2**30  # not 0.75 (or 0.5) of it
    plan = fake_plan(monkeypatch, v5p, total=95 * 2**30 - 1)  # above 0.75 of the HBM
    assert plan["fits"] and "1 of the chip's HBM" in plan["memory"]["usable_is"]
    assert not fake_plan(monkeypatch, v5p, total=95 * 2**30 + 1)["fits"]


def test_a_fixed_step_odes_loops_run_its_steps(monkeypatch):
    import types

    ode = types.SimpleNamespace(is_adaptive=False, num_steps=12)
    plan = fake_plan(monkeypatch, targets.get("cpu:4"), model=types.SimpleNamespace(max_seq_len=32, ode=ode))
    # body 12 times, condition 13 times, each condition a host synchronisation
    assert plan["kernels"]["launches"] == 12 + 13 and plan["kernels"]["host_syncs"] == 13
    assert plan["estimate"]["unknown_trip_counts_taken_as"] == 12
    adaptive = types.SimpleNamespace(is_adaptive=True, num_steps=12)
    plan = fake_plan(monkeypatch, targets.get("cpu:4"), model=types.SimpleNamespace(max_seq_len=32, ode=adaptive))
    assert plan["kernels"]["launches"] == 1 + 2 and plan["kernels"]["host_syncs"] == 2  # no count to take


def test_the_plan_reports_its_compile_time(monkeypatch):
    from qkvflow.plan import report

    plan = fake_plan(monkeypatch, targets.get("H100-80GB"))
    assert plan["compile_s"] == 12.5
    text = report.text(plan)
    assert "compiled in 12.5 s" in text
    assert "host synchronisations per step: 2 (2 in loops without a known trip count, 0 at conditionals)" in text
    tpu = fake_plan(monkeypatch, targets.get("v5p"))
    assert "host synchronisations" not in report.text(tpu)  # a TPU runs its loops on the chip


def test_the_batch_splits_over_replica_dcn_too(monkeypatch):
    assert step.data_parallel({"data": 4, "replica": 1, "model": 2, "replica_dcn": 2}) == 8
    plan = fake_plan(monkeypatch, targets.get("cpu:4"), mesh={"data": 2, "model": 1, "replica_dcn": 2}, batch=8)
    assert plan["batch"] == {"global": 8, "per_device": 2, "seq_len": 32}  # 8 over 2 x 2 devices


def test_model_flops_are_per_device():
    from levanter.models.gpt2 import Gpt2Config

    config = __import__("types").SimpleNamespace(
        model=Gpt2Config(max_seq_len=32, hidden_dim=32, num_heads=2, num_layers=1)
    )
    forward = config.model.flops_per_token(64, 32)
    tokens = 8 * 32
    assert planner.model_flops_per_device(config, 64, 8, 1) == pytest.approx(3 * forward * tokens, rel=1e-12)
    assert planner.model_flops_per_device(config, 64, 8, 4) == pytest.approx(3 * forward * tokens / 4, rel=1e-12)


def test_the_devices_of_two_nodes_are_laid_out_as_levanters_multi_slice_mesh():
    import types

    devices = [types.SimpleNamespace(id=i, node=i // 4) for i in range(8)]
    grid = step.device_grid({"data": 2, "replica": 1, "model": 2}, {"replica_dcn": 2}, devices, lambda d: d.node)
    # axes data, replica, model, replica_dcn; each node a 2 x 1 x 2 block, the two blocks side by side
    # along replica_dcn: node 0's devices 0-3 at replica_dcn 0, node 1's 4-7 at 1
    assert grid.shape == (2, 1, 2, 2)
    ids = [[[[grid[d, 0, m, r].id for r in range(2)] for m in range(2)] for d in range(2)]]
    assert ids == [[[[0, 4], [1, 5]], [[2, 6], [3, 7]]]]
    with pytest.raises(UserError, match="DCN axes"):
        step.device_grid({"data": 4, "replica": 1, "model": 1}, {"replica_dcn": 2}, devices[:6], lambda d: d.id // 4)


def test_tpu_slices_come_from_the_meshs_dcn_axes():
    import types

    def config(dcn):
        return types.SimpleNamespace(trainer=types.SimpleNamespace(mesh=types.SimpleNamespace(dcn_axes=dcn)))

    assert planner.tpu_slices(config({"replica_dcn": -1})) == 1  # Levanter's default: as many as there are
    assert planner.tpu_slices(config({"replica_dcn": 2})) == 2
    assert planner.tpu_slices(config({"replica_dcn": 2, "data": 3})) == 6
    # 16 v5p chips in 2 slices: two v5p:2x2x2 slices (libtpu's num_slices)
    assert backend.tpu_topology("v5p", 16, 2) == "v5p:2x2x2"
    assert backend.tpu_topology("v5e", 8, 1) == "v5e:2x4"
    with pytest.raises(UserError, match="--devices 12 does not split into 8 TPU slices"):
        backend.tpu_topology("v5p", 12, 8)
