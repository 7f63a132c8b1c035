"""`qkvflow plan` on CPU targets: one compiled plan shared by the tests, and every one-line refusal.

The plan of tests/configs/plan_tiny.yaml (a one-layer GPT-2) on `cpu:1` is compiled once for the
module; its numbers are checked against counts made here from the model's shapes. `cpu:2` (FSDP over
two devices) needs a process of its own (a plan fixes the device count) and runs as a subprocess.
"""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import jax
import pytest

from tests.helpers import with_host_devices
from tests.timescale import limit

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "tests/configs/plan_tiny.yaml")
VOCAB = 64


def cli(capsys, *args):
    from qkvflow.cli import main

    rc = main(["plan", *args])
    out, err = capsys.readouterr()
    return rc, out, err


def parameter_bytes() -> int:
    """4 bytes (f32) per parameter (floating-point array element) of the config's model, from its shapes."""
    import haliax as hax
    import jax.random as jrandom

    from qkvflow import cli as qcli
    from qkvflow.plan.config import PlanConfig

    config = qcli.parse(PlanConfig, ["--config_path", TINY], "plan")
    model = jax.eval_shape(lambda: config.model.build(hax.Axis("vocab", VOCAB), key=jrandom.PRNGKey(0)))
    leaves = [x for x in jax.tree_util.tree_leaves(model) if jax.numpy.issubdtype(x.dtype, jax.numpy.floating)]
    return 4 * sum(math.prod(x.shape) for x in leaves)


@pytest.fixture(scope="module")
def plan():
    from qkvflow import cli as qcli
    from qkvflow.plan import backend, planner, targets
    from qkvflow.plan.config import PlanConfig, vocabulary

    jax.devices()  # this process's backend, as the rest of the suite has it: one CPU device
    backend.start(1)
    config = qcli.parse(PlanConfig, ["--config_path", TINY], "plan")
    return planner.plan(config, targets.get("cpu:1"), 1, vocabulary(config))


def test_the_plan_counts_the_state_each_device_holds(plan):
    m = plan["memory"]
    params = parameter_bytes()
    assert m["parameters"] == params == m["gradients"]
    assert 2 * params <= m["optimizer_state"] <= 2 * params + 1024  # Adam's two moments and a few counters
    # tokens (int32), loss weights (f32), the segment ids of queries and of keys (int32 each)
    assert m["batch"] == 4 * 32 * (4 + 4 + 4 + 4)
    # the step's arguments hold the parameters, both moments and the batch (XLA drops unused scalars)
    assert m["arguments"] >= 3 * params + m["batch"]
    # the state is donated: its updated copy (the step's outputs but the loss and a few scalars) is
    # written over its arguments, so the step needs the state once, plus its temporaries
    assert m["aliased"] >= 3 * params and m["outputs"] - m["aliased"] < 1024
    assert m["arguments"] + m["temporaries"] <= m["total"] < m["arguments"] + m["temporaries"] + 1024
    assert plan["fits"] and m["usable"] == 16 * 2**30


def test_the_plan_describes_the_step(plan):
    assert plan["batch"] == {"global": 4, "per_device": 4, "seq_len": 32}
    assert plan["mesh"]["data"] == 1 and plan["vocab_size"] == VOCAB
    k = plan["kernels"]
    # the step's loops (all with a known trip count, none inside another: XLA's CPU loops over the
    # layer's scan and a few elementwise ops) run their bodies trip-count times and their conditions
    # never: the launches are the ones outside loops plus trips x each body's
    loops = k["loops"]
    assert loops and all(loop["known"] for loop in loops) and max(loop["trip_count"] for loop in loops) > 1
    assert k["launches"] == k["once_per_step"] + sum(
        loop["trip_count"] * loop["launches_per_iteration"] for loop in loops
    )
    assert k["host_syncs"] == k["host_syncs_by"]["conditional"]  # no loop without a trip count
    assert plan["estimate"]["step_s"] is None  # no peak for a CPU
    assert plan["estimate"]["calibrated"]["calibrated"] is False  # and no measured step to calibrate against
    # the model FLOPs: Levanter's 3 x forward of a GPT-2 (its own flops_per_token) x the tokens
    from levanter.models.gpt2 import Gpt2Config

    forward = Gpt2Config(max_seq_len=32, hidden_dim=32, num_heads=2, num_layers=1).flops_per_token(VOCAB, 32)
    assert plan["estimate"]["model_flops"] == pytest.approx(3 * forward * 4 * 32, rel=1e-9)


def test_the_verb_prints_the_plan_as_text_or_json(capsys, monkeypatch, plan):
    from qkvflow.plan import planner

    monkeypatch.setattr(planner, "plan", lambda *a, **k: plan)  # the verb only parses and dispatches
    rc, out, err = cli(capsys, "--config_path", TINY, "--target", "cpu:1", "--json")
    assert rc == 0 and json.loads(out) == plan
    rc, out, err = cli(capsys, "--config_path", TINY, "--target", "cpu:1")
    assert rc == 0 and "=> fits" in out and "ESTIMATE" in out and "kernel launches per step" in out
    assert "NOT CALIBRATED for cpu:1" in out


def test_fsdp_over_two_devices_halves_the_state_and_gathers_it():
    env = {**os.environ, "XLA_FLAGS": with_host_devices(2)}
    cmd = [sys.executable, "-m", "qkvflow", "plan", "--config_path", TINY, "--target", "cpu:2", "--json"]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=limit(600))
    assert done.returncode == 0, done.stderr[-2000:]
    plan = json.loads(done.stdout)
    assert plan["mesh"]["data"] == 2 and plan["batch"]["per_device"] == 2
    params = parameter_bytes()
    assert params / 2 <= plan["memory"]["parameters"] < params  # embed-sharded arrays split, the rest whole
    assert plan["collectives"]["all-gather"]["group_size"] == 2


def one_line_refusal(capsys, *args) -> str:
    rc, out, err = cli(capsys, "--config_path", TINY, *args)
    assert rc == 2 and out == "" and err.count("\n") == 1 and err.startswith("qkvflow plan: error: ")
    return err


def test_an_unknown_target_is_refused_with_the_known_ones(capsys):
    err = one_line_refusal(capsys, "--target", "TPU-v9")
    assert "--target 'TPU-v9' is unknown: expected one of H100-80GB, H200, A100-80GB, v5e, v5p, cpu:N" in err


def test_a_gpu_target_without_the_plugin_names_the_install(capsys, monkeypatch, plan):
    monkeypatch.setitem(sys.modules, "jax_plugins.xla_cuda12", None)  # as if not installed
    err = one_line_refusal(capsys, "--target", "H100-80GB")
    assert "--target H100-80GB needs the CUDA plugin: pip install -e '.[gpu]'" in err


def test_a_tpu_target_without_libtpu_names_the_install(capsys, monkeypatch, plan):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "libtpu" else real(name, *a))
    err = one_line_refusal(capsys, "--target", "v5p", "--devices", "1")
    assert "--target v5p needs libtpu: pip install -e '.[tpu]'" in err


def test_a_mesh_that_does_not_divide_the_devices_is_refused(capsys, plan):
    err = one_line_refusal(capsys, "--target", "cpu:1", "--trainer.mesh.axes", "{data: -1, replica: 1, model: 3}")
    assert "trainer.mesh does not fit 1 devices: the fixed axes (model=3) need a multiple of 3 devices" in err


def test_a_device_count_this_process_cannot_have_is_refused(capsys, plan):
    err = one_line_refusal(capsys, "--target", "cpu:2")
    assert "--devices 2: this process already started JAX with 1 devices" in err
    err = one_line_refusal(capsys, "--target", "cpu:2", "--devices", "4")
    assert "--devices 4 contradicts --target cpu:2" in err


def test_a_config_whose_step_does_not_compile_is_refused(capsys, plan):
    err = one_line_refusal(capsys, "--target", "cpu:1", "--model.attn_backend", "splash")
    assert "the training step does not compile for cpu:1: NotImplementedError: Could not use splash attention" in err
