"""Checks that need an accelerator (`pytest -m gpu`, run by benchmarks/accelerator.sh, whose CPU dry run in
tests/test_accelerator_script.py checks that each of them skips there).

On a CPU backend every gpu-marked test skips, so the default suite (which collects them) stays CPU-only.
`QKVFLOW_GPU_TESTS_ON_CPU=1 pytest -m gpu tests/test_gpu.py` runs them on the CPU anyway (two
simulated devices for the multi-device test), to check the tests themselves.

* a training step's losses on 1 device == on 2 devices (data parallel + FSDP), through `qkvflow train`;
* the ODE model's logits == the discretised M = N layer model's, computed on the accelerator;
* logits of the exported Hugging Face folder (torch, CPU) == the JAX model's on the accelerator.

Matmuls run at float32 precision (`highest`): accelerators otherwise use TF32/bf16 passes for float32
matmuls, which is not what these tolerances (float32 round-off) are about.
"""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.helpers import Vocab, with_host_devices
from tests.timescale import limit
from tests.train_utils import losses, train_args

FORCE_ON_CPU = os.environ.get("QKVFLOW_GPU_TESTS_ON_CPU") == "1"
N = 4  # ode.num_steps of tests.helpers.tiny_config
PRECISION = "highest"


def needs(devices: int = 1) -> str:
    """Skip unless the default backend is an accelerator with `devices` devices (or forced onto the CPU);
    return the backend's platform."""
    import jax

    backend = jax.default_backend()
    if FORCE_ON_CPU:
        return backend
    if backend == "cpu":
        pytest.skip("needs an accelerator (QKVFLOW_GPU_TESTS_ON_CPU=1 runs it on the CPU)")
    if jax.device_count() < devices:
        pytest.skip(f"needs {devices} devices, found {jax.device_count()}")
    return backend


def _device_env(platform: str, devices: int) -> dict:
    """The environment of a `qkvflow train` subprocess that sees exactly `devices` devices."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", JAX_DEFAULT_MATMUL_PRECISION=PRECISION)
    if platform == "cpu":
        env["JAX_PLATFORMS"] = "cpu"
        env["XLA_FLAGS"] = with_host_devices(devices)
    elif platform == "gpu":
        env.pop("JAX_PLATFORMS", None)
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in range(devices))
    elif platform == "tpu":
        env.pop("JAX_PLATFORMS", None)
        env.update(TPU_VISIBLE_CHIPS=",".join(str(i) for i in range(devices)), TPU_PROCESS_BOUNDS="1,1,1")
        env["TPU_CHIPS_PER_PROCESS_BOUNDS"] = {1: "1,1,1", 2: "1,2,1"}[devices]
    else:
        pytest.skip(f"no way to restrict the {platform} backend to {devices} devices")
    return env


def _train(workdir: Path, corpus_root: Path, platform: str, devices: int) -> list[float]:
    env = _device_env(platform, devices)
    probe = [sys.executable, "-c", "import jax; print(jax.default_backend(), jax.device_count())"]
    seen = subprocess.run(probe, env=env, capture_output=True, text=True, timeout=limit(300)).stdout.split()
    assert seen == [platform, str(devices)], seen  # the environment really gives the run `devices` devices
    workdir.mkdir(parents=True)
    args = train_args(workdir, corpus_root, "--trainer.num_train_steps", "4")
    proc = subprocess.run(args, cwd=workdir, env=env, capture_output=True, text=True,
                          timeout=limit(900))  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return losses(workdir)


@pytest.mark.gpu
def test_two_devices_train_to_the_losses_of_one(tmp_path, request):
    platform = needs(devices=2)
    corpus_root = request.getfixturevalue("corpus_root")  # after the skip: building it takes a while
    one = _train(tmp_path / "one", corpus_root, platform, 1)
    two = _train(tmp_path / "two", corpus_root, platform, 2)
    assert len(one) == 4 and np.all(np.isfinite(one))
    assert two == pytest.approx(one, rel=2e-5, abs=2e-5)  # as tests/test_train.py's 4-device CPU check


def _logits(model, tokens) -> np.ndarray:
    return np.asarray(model(tokens).array)


def _tokens(config, batch: int = 2):
    import haliax as hax

    ids = np.random.default_rng(0).integers(0, Vocab.size, size=(batch, config.max_Pos.size)).astype(np.int32)
    return hax.named(ids, (hax.Axis("batch", batch), config.max_Pos))


@pytest.mark.gpu
@pytest.mark.parametrize("flavour", ["gpt2", "llama"])
def test_the_ode_and_its_n_layer_discretisation_give_the_same_logits(flavour):
    import jax

    from qkvflow.models.discretise import discretise
    from tests.analysis.builders import filled
    from tests.helpers import tiny_config

    needs()
    config = tiny_config(flavour)
    with jax.default_matmul_precision(PRECISION):
        model = filled(config, std=0.1)
        tokens = _tokens(config)
        expected = _logits(model, tokens)
        got = _logits(discretise(model, N), tokens)
    assert np.all(np.isfinite(expected))
    assert np.abs(got - expected).max() <= 1e-5 * np.abs(expected).max()  # as tests/test_discretise.py


@pytest.mark.gpu
@pytest.mark.parametrize("flavour", ["gpt2", "llama"])
def test_exported_hf_logits_match_the_accelerators(tmp_path, flavour):
    needs()  # before torch's import (~7 s), which a skip on the CPU does not need
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    import jax
    from transformers import AutoModelForCausalLM

    from qkvflow.export.hf_folder import save_hf_folder
    from qkvflow.models.discretise import discretise
    from tests.analysis.builders import filled
    from tests.helpers import tiny_config

    config = tiny_config(flavour)
    ids = _tokens(config)
    with jax.default_matmul_precision(PRECISION):
        model = filled(config, std=0.1)
        discrete = discretise(model, N)
        jax_logits = _logits(discrete, ids)
        ode_logits = _logits(model, ids)
    save_hf_folder(discrete, str(tmp_path), ode_steps=N)
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path), trust_remote_code=True).eval()
    with torch.no_grad():
        torch_logits = hf(torch.tensor(np.asarray(ids.array), dtype=torch.long)).logits.numpy()

    def relative_error(a, b):
        return float(np.abs(a - b).max() / np.abs(b).max())

    assert relative_error(torch_logits, jax_logits) < 1e-4  # as tests/hf/test_export.py
    assert relative_error(torch_logits, ode_logits) < 1e-4
