"""`qkvflow plan` for an H200 against what an H200 measured (runs where the `gpu` extra is installed).

benchmarks/results/accelerator_h200_2026-11-26/speed_small.json holds XLA's memory of the
DiffEqFormer's training step at benchmarks/configs/accelerator_small.yaml, bfloat16 compute, batch 8
and 32, read on the H200 (`xla_memory.total_bytes`; the allocator's peak agreed to 0.2%). The plan,
compiled on a CPU for the H200 target, must give the same bytes within 1%.
"""

import importlib.util
import json
from pathlib import Path

import jax
import pytest

ROOT = Path(__file__).resolve().parents[2]
MEASURED = ROOT / "benchmarks/results/accelerator_h200_2026-11-26/speed_small.json"


def has_cuda_plugin() -> bool:
    try:
        return importlib.util.find_spec("jax_plugins.xla_cuda12") is not None
    except ModuleNotFoundError:  # no jax_plugins package at all
        return False


pytestmark = pytest.mark.skipif(
    not has_cuda_plugin(),
    reason="needs the CUDA plugin to compile for a GPU: pip install -e '.[gpu]'",
)


def measured(batch: int) -> int:
    runs = json.loads(MEASURED.read_text())["runs"]
    (run,) = [r for r in runs if r["config"]["batch"] == batch and r["config"]["dtype"] == "bf16"]
    return run["ode"]["xla_memory"]["total_bytes"]


@pytest.mark.parametrize("batch", [8, 32])
def test_the_h200_plan_matches_the_h200s_memory(batch):
    from qkvflow import cli
    from qkvflow.plan import backend, planner, targets
    from qkvflow.plan.config import PlanConfig, vocabulary

    jax.devices()
    backend.start(1)
    args = ["--config_path", str(ROOT / "benchmarks/configs/accelerator_small.yaml")]
    args += ["--trainer.train_batch_size", str(batch), "--trainer.mp", "p=f32,c=bfloat16"]
    args += ["--hypernetwork_mu_dtype", "float32"]  # as measured (before bfloat16 became the default)
    config = cli.parse(PlanConfig, args, "plan")
    plan = planner.plan(config, targets.get("H200"), 1, vocabulary(config))
    assert plan["memory"]["total"] == pytest.approx(measured(batch), rel=0.01)
    assert plan["vocab_size"] == 50257 and plan["fits"]
    assert plan["attention"]["kernels"][0].startswith("__cudnn$fmha")  # cuDNN's fused attention, as measured
    assert 0 < plan["estimate"]["mfu"] < 1
