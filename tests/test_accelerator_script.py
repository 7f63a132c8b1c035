"""benchmarks/accelerator.sh: shellcheck-clean, its --help and refusals, and its --cpu-dry-run end to end
(quickstart, `pytest -m gpu`, `bench speed` for the DiffEqFormer and its GPT-2 at a batch and at the largest
that fits, Levanter's own train_lm, the summary) on the CPU."""

import csv
import json
import os
import subprocess
import sys
from pathlib import Path
from xml.etree import ElementTree

import jax
import pytest

from tests.test_launch import shellcheck
from tests.timescale import limit

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "accelerator.sh"


SCRIPT_LIMIT = limit(60)
"""Seconds a quick invocation of the script may take (tests/timescale.py)."""


def script(*args: str, timeout: float = SCRIPT_LIMIT, **env: str) -> subprocess.CompletedProcess:
    environ = {**os.environ, "PYTHON": sys.executable, **env}
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=ROOT, env=environ, capture_output=True, text=True,
                          timeout=timeout)  # fmt: skip


@pytest.mark.parametrize("name", ["accelerator.sh", "device_compare.sh"])
def test_shellcheck(name):
    proc = subprocess.run([shellcheck(), "-x", f"benchmarks/{name}"], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize(
    "args, env, message",
    [
        ([], {}, "usage: device_compare.sh compare/STUDY.yaml"),
        (["compare/missing.yaml"], {}, "benchmarks/compare/missing.yaml is not a file"),
        (["compare/depth_dial_impulse.yaml"], {"OUT": None}, "OUT is not set"),
    ],
)
def test_device_compare_refuses_before_it_starts_anything(tmp_path, args, env, message):
    """benchmarks/device_compare.sh (the device runs of benchmarks/README.md) names what is wrong in one
    line and exits non-zero before it writes a log or starts a study."""
    environ = {k: v for k, v in {**os.environ, "OUT": str(tmp_path / "out"), **env}.items() if v is not None}
    proc = subprocess.run(["bash", "benchmarks/device_compare.sh", *args], cwd=ROOT, env=environ,
                          capture_output=True, text=True, timeout=limit(60))  # fmt: skip
    assert proc.returncode != 0 and message in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert not (tmp_path / "out").exists()


def test_device_compare_passes_its_extra_options_to_bench_compare(tmp_path):
    """Options after the study file reach `qkvflow bench compare` unchanged (the device calls of
    benchmarks/README.md name `--models` there); a stand-in `python3` on PATH records its arguments."""
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "python3").write_text('#!/bin/sh\nprintf "%s|" "$@" >> "$RECORD"; echo >> "$RECORD"\n')
    (fake / "python3").chmod(0o755)
    (tmp_path / "out").mkdir()
    env = {**os.environ, "PATH": f"{fake}:{os.environ['PATH']}", "OUT": str(tmp_path / "out"),
           "RECORD": str(tmp_path / "calls"), "STUDY_LOGS": str(tmp_path / "logs"), "PACK_EVERY": "0.2"}  # fmt: skip
    proc = subprocess.run(["bash", "benchmarks/device_compare.sh", "compare/depth_dial_rest.yaml", "--models", "ode,jitter"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=limit(60))  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    calls = (tmp_path / "calls").read_text().splitlines()
    study = [c for c in calls if c.startswith("-m|qkvflow|bench|compare|")]
    assert study == ["-m|qkvflow|bench|compare|benchmarks/compare/depth_dial_rest.yaml|--workdir|/tmp/study|--jobs|12|"
                     "--models|ode,jitter|"], calls  # fmt: skip
    assert (tmp_path / "out" / "status.txt").is_file()  # the logs come back under $OUT, kept outside it


def test_help_names_every_step_and_option():
    proc = script("--help")
    assert proc.returncode == 0, proc.stderr
    for word in ("install", "quickstart", "pytest -m gpu", "bench speed", "summary", "--out", "--extra", "--steps",
"--corpora", "--no-install", "--batches", "--max-batch", "levanter.main.train_lm", "--cpu-dry-run", "accelerator_{small,medium}.yaml", "MFU", "peak memory"):  # fmt: skip
        assert word in proc.stdout, word
    for shape in ("small", "medium", "dry_run"):
        assert (ROOT / "benchmarks" / "configs" / f"accelerator_{shape}.yaml").is_file()


@pytest.mark.parametrize(
    "args, message",
    [
        (["--bogus"], "unknown option '--bogus'"),
        (["--out"], "--out needs a value"),
        (["--corpora"], "--corpora needs a value"),
        (["--steps", "quickstart,lint", "--cpu-dry-run"], "unknown step 'lint'"),
        (["--cpu-dry-run", "--steps", "install"], "--cpu-dry-run does not install"),
        (["--extra", "rocm", "--steps", "summary"], "--extra must be gpu or tpu, got 'rocm'"),
        (["--no-install", "--extra", "gpu", "--steps", "install,speed"], "--no-install does not install"),
    ],
)
def test_bad_arguments_are_refused_in_one_line(tmp_path, args, message):
    proc = script(*args, "--out", str(tmp_path / "out")) if args not in (["--out"], ["--corpora"]) else script(*args)
    assert proc.returncode == 2 and proc.stdout == "", proc.stdout + proc.stderr
    assert message in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_no_install_uses_the_installed_jax_or_says_it_cannot(tmp_path):
    """--no-install: the interpreter's jax is checked before any step; without one, one line and exit 2."""
    proc = script("--no-install", "--extra", "gpu", "--steps", "summary", "--out", str(tmp_path), PYTHON="/bin/false")
    assert proc.returncode == 2 and proc.stdout == "", proc.stdout + proc.stderr
    assert "--no-install: /bin/false cannot import jax" in proc.stderr and len(proc.stderr.splitlines()) == 1
    proc = script("--no-install", "--extra", "gpu", "--steps", "summary", "--out", str(tmp_path))
    assert f"using the installed jax {jax.__version__}" in proc.stdout, proc.stdout + proc.stderr
    assert "install" not in (tmp_path / "status.tsv").read_text()  # only the summary ran (none to sum up: exit 1)


def test_an_interpreter_without_qkvflows_dependencies_is_refused_in_one_line(tmp_path):
    """The state right after the README's set-up (a venv made, not activated): python3 lacks draccus & co.
    With no install step the script says so in one line naming PYTHON=.venv/bin/python, before any step
    (no results folder), rather than a traceback from each step. Without $PYTHON it takes the project's
    .venv/bin/python when there is one (else python3: here a bare venv's, put first on PATH)."""
    bare = tmp_path / "bare"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(bare)], check=True)
    out = tmp_path / "out"
    proc = script("--cpu-dry-run", "--out", str(out), PYTHON=str(bare / "bin" / "python"))
    assert proc.returncode == 2 and proc.stdout == "", proc.stdout + proc.stderr
    assert f"{bare / 'bin' / 'python'} cannot import qkvflow's dependencies (ModuleNotFoundError" in proc.stderr
    assert "PYTHON=.venv/bin/python" in proc.stderr and len(proc.stderr.splitlines()) == 1, proc.stderr
    assert not out.exists()

    environ = {k: v for k, v in os.environ.items() if k not in ("PYTHON", "VIRTUAL_ENV")}
    environ["PATH"] = f"{bare / 'bin'}:/usr/bin:/bin"
    proc = subprocess.run(["bash", str(SCRIPT), "--cpu-dry-run", "--steps", "summary", "--out", str(out)], cwd=ROOT,
                          env=environ, capture_output=True, text=True, timeout=limit(60))  # fmt: skip
    if (ROOT / ".venv" / "bin" / "python").exists():  # a clone set up as the README says
        assert "cannot import" not in proc.stderr and (out / "summary.log").is_file(), proc.stderr
    else:
        assert proc.returncode == 2 and "python3 cannot import qkvflow's dependencies" in proc.stderr, proc.stderr


def _gpu_marked(path: Path) -> set[str]:
    """The test functions of `path` under a `pytest.mark` decorator named gpu (read from its syntax tree)."""
    import ast

    def gpu(decorator) -> bool:
        return (
            isinstance(decorator, ast.Attribute)
            and decorator.attr == "gpu"
            and getattr(decorator.value, "attr", "") == "mark"
        )

    tree = ast.parse(path.read_text())
    return {f.name for f in tree.body if isinstance(f, ast.FunctionDef) and any(gpu(d) for d in f.decorator_list)}


def test_the_cpu_dry_run_runs_every_step(tmp_path, corpus_root):
    """The whole dry run, its quickstart on the session's corpus (--corpora; a corpus of its own under
    --out is the default, and costs a tokenizer build)."""
    out = tmp_path / "results"
    proc = script("--cpu-dry-run", "--out", str(out), "--corpora", str(corpus_root), timeout=limit(900),
                  QKVFLOW_GPU_TESTS_ON_CPU="0")  # fmt: skip
    log = proc.stdout[-4000:] + proc.stderr[-4000:]
    assert proc.returncode == 0, log
    with open(out / "status.tsv") as f:
        status = [row for row in csv.reader(f, delimiter="\t")]
    assert [row[0] for row in status] == ["quickstart", "tests", "speed", "speed", "reference", "summary"], status
    # Levanter's Pallas cross-entropy sweep is off on a miss for every step, unless the caller set it
    assert "autotuning on a miss: LEVANTER_PALLAS_CE_AUTOTUNE_ON_MISS=0\n" in proc.stdout
    assert all(row[1] == "0" for row in status), status

    metrics = out / "runs" / "accelerator_quickstart" / "metrics.jsonl"
    assert metrics.is_file() and (out / "checkpoints" / "accelerator_quickstart").is_dir()
    # `pytest -m gpu` selects tests/test_gpu.py's checks, and on the CPU each skips (not fails) for want of an
    # accelerator (QKVFLOW_GPU_TESTS_ON_CPU=1 would run them)
    cases = ElementTree.parse(out / "pytest_gpu.xml").getroot().iter("testcase")
    ours = [case for case in cases if case.get("classname") == "tests.test_gpu"]
    assert {case.get("name").split("[")[0] for case in ours} == _gpu_marked(ROOT / "tests" / "test_gpu.py")
    for case in ours:
        skipped = case.find("skipped")
        assert skipped is not None and "needs an accelerator" in skipped.get("message"), ElementTree.tostring(case)

    summary = json.loads((out / "summary.json").read_text())
    rows = summary["speed"]
    # --batch max --max_batch 2: the largest batch that fits from 2 down (2, on the CPU)
    assert [(r["shape"], r["role"], r["batch"]) for r in rows] == [("dry_run", "baseline", 2), ("dry_run", "ode", 2)]
    assert {r["attention"] for r in rows} == {"jax_flash"}  # auto on a CPU: one kernel for both models
    for r in rows:
        assert r["tokens_per_s"] > 0 and r["peak_memory_bytes"] > 0 and r["parameters"] > 0
        assert r["mfu_nominal"] is None  # no nominal peak for a CPU
    assert rows[0]["model"] == "Gpt2Config" and rows[1]["model"].startswith("DiffEqFormer")
    reference = summary["levanter_train_lm"]
    assert reference["tokens_per_s"] > 0 and reference["tokens_per_step"] == 2 * 32 and reference["mfu"] is None
    summary = (out / "summary.md").read_text()
    assert "| dry_run | 2 | Gpt2Config (baseline) |" in summary and "tokens/s" in summary
    assert "Levanter's own train_lm, GPT-2 small, batch 2" in summary
    assert not (ROOT / "accelerator_quickstart").exists()  # nothing written outside --out
    assert not (out / "corpora").exists()  # the quickstart used --corpora


def test_a_callers_pallas_autotune_setting_is_kept(tmp_path):
    """The script turns Levanter's cross-entropy sweep off only where the caller has not chosen."""
    proc = script("--cpu-dry-run", "--steps", "summary", "--out", str(tmp_path / "out"),
                  LEVANTER_PALLAS_CE_AUTOTUNE_ON_MISS="1")  # fmt: skip
    assert "autotuning on a miss: LEVANTER_PALLAS_CE_AUTOTUNE_ON_MISS=1\n" in proc.stdout, proc.stdout + proc.stderr
