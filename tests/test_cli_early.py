"""The command line's start-up seam (qkvflow.cli.startup.early): `--help` and the refusals that need no verb
module are answered without importing JAX, Levanter, transformers or draccus; each refusal is one
line naming the value, exit status 2; Ctrl-C ends a verb with one line and exit status 130
(qkvflow.cli.startup.interrupt). How fast that is on a given machine is measured by benchmarks/cli_latency.py."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import tomllib
from pathlib import Path

import pytest

from qkvflow.cli.startup import early
from tests.timescale import limit

ROOT = Path(__file__).resolve().parents[1]
Q = "configs/quickstart.yaml"
TINY_PLAN = "tests/configs/plan_tiny.yaml"
HEAVY = (
    "jax",
    "jaxlib",
    "numpy",
    "levanter",
    "haliax",
    "equinox",
    "diffrax",
    "optax",
    "transformers",
    "torch",
    "draccus",
)
"""Top-level packages that the seam must not import."""
LIMIT = limit(600)
"""Seconds a subprocess may take before it counts as hung (generous: the suite runs on loaded machines)."""


def _in_one_process(cases: list[list[str]], cwd: Path) -> list[dict]:
    """Run `qkvflow.cli.main(argv)` for each case in one fresh process: status, stdout, stderr, and the
    HEAVY packages in sys.modules after it."""
    script = textwrap.dedent(
        f"""
        import contextlib, io, json, sys
        from qkvflow.cli import main
        out = []
        for argv in json.loads(sys.argv[1]):
            o, e = io.StringIO(), io.StringIO()
            with contextlib.redirect_stdout(o), contextlib.redirect_stderr(e):
                try:
                    rc = main(argv)
                except SystemExit as exit:  # argparse's verbs, were they reached
                    rc = exit.code
            heavy = sorted(m for m in sys.modules if m.split(".")[0] in {HEAVY!r})
            out.append({{"rc": rc, "out": o.getvalue(), "err": e.getvalue(), "heavy": heavy}})
        print(json.dumps(out))
        """
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [sys.executable, "-c", script, json.dumps(cases)],
        cwd=cwd,
        capture_output=True,
        text=True,
        env=env,
        timeout=LIMIT,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    w = tmp_path_factory.mktemp("early")
    (w / "ckpt").mkdir()
    (w / "a.txt").write_text("some text\n")
    (w / "malformed.yaml").write_text("model: {type: [\n")
    (w / "typo_type.yaml").write_text(
        (ROOT / Q).read_text().replace("type: diffeqformer_gpt2", "type: difeqformer_gpt2")
    )
    assert "difeqformer_gpt2" in (w / "typo_type.yaml").read_text()
    (w / "typo_key.yaml").write_text((ROOT / Q).read_text().replace("\noptimizer:", "\noptimiser:"))
    assert "\noptimiser:" in (w / "typo_key.yaml").read_text()
    return w


def refusals(w: Path) -> dict:
    """id -> (argv, the verb the line names, what the one line must contain)."""
    q, ckpt, missing = str(ROOT / Q), str(w / "ckpt"), str(w / "nothing")
    return {
        "unknown-verb": (["trian"], None, ["unknown verb 'trian'", "did you mean train?"]),
        "missing-config": (["describe", "--config_path", missing], "describe", [f"config file '{missing}' does not exist"]),
        "malformed-config": (["train", "--config_path", str(w / "malformed.yaml")], "train", ["malformed.yaml is not valid YAML"]),
        "old-key": (["train", "--config_path", q, "--model.seq_len", "64"], "train", ["model.seq_len was removed"]),
        "eval-checkpoint": (["eval", "--config_path", q, "--checkpoint", missing], "eval", [f"--checkpoint: '{missing}' does not exist"]),
        "generate-prompts": (
            ["generate", "--config_path", q, "--checkpoint", ckpt, "--prompts_file", missing], "generate",
            [f"--prompts_file: '{missing}' does not exist"],
        ),
        "export-checkpoint": (
            ["export", "--config_path", q, "--checkpoint=" + missing, "--output", str(w / "out")], "export",
            [f"--checkpoint: '{missing}' does not exist"],
        ),
        "analyze-checkpoint": (
            ["analyze", "spectra", "--config_path", q, "--checkpoint", missing], "analyze",
            [f"--checkpoint: '{missing}' does not exist"],
        ),
        "tokenizer-files": (
            ["tokenizer", "--files", str(w / "a.txt"), missing, "--output", str(w / "tok")], "tokenizer",
            [f"--files: '{missing}' does not exist"],
        ),
        "eval-steps": (["eval", "--config_path", q, "--checkpoint", ckpt, "--steps", "2,x"], "eval", ["--steps '2,x' is invalid"]),
        "eval-auto-grids": (
            ["eval", "--config_path", q, "--checkpoint", ckpt, "--steps", "auto", "--auto_grids", "N/2,,N"], "eval",
            ["--auto_grids 'N/2,,N' is invalid"],
        ),
        "generate-two-grids": (
            ["generate", "--config_path", q, "--checkpoint", ckpt, "--steps", "2,4"], "generate",
            ["--steps '2,4' is invalid: expected one grid N'"],
        ),
        "export-zero-layers": (
            ["export", "--config_path", q, "--checkpoint", ckpt, "--steps", "0", "--output", str(w / "out")], "export",
            ["--steps 0 is invalid: expected an integer >= 1"],
        ),
        "model-type-override": (
            ["describe", "--config_path", q, "--model.type", "diffeqformr"], "describe",
            ["model.type 'diffeqformr' is unknown: expected one of", "gpt2, ", "did you mean diffeqformer_gpt2?"],
        ),
        "model-type-in-file": (
            ["train", "--config_path", str(w / "typo_type.yaml")], "train",
            ["model.type 'difeqformer_gpt2' is unknown", "did you mean diffeqformer_gpt2?"],
        ),
        "plan-target": (
            ["plan", "--config_path", q, "--target", "h100"], "plan",
            ["--target 'h100' is unknown: expected one of H100-80GB,", "did you mean H100-80GB?"],
        ),
        "plan-no-target": (["plan", "--config_path", q], "plan", ["--target is missing"]),
        "plan-zero-devices": (
            ["plan", "--config_path", q, "--target", "H200", "--devices", "0"], "plan",
            ["--devices 0 is invalid: expected an integer >= 1"],
        ),
        "plan-devices-against-cpu-n": (
            ["plan", "--config_path", q, "--target", "cpu:2", "--devices", "3"], "plan",
            ["--devices 3 contradicts --target cpu:2"],
        ),
        "plan-mesh": (
            ["plan", "--config_path", q, "--target", "H200", "--devices", "8", "--trainer.mesh.axes", "{model: 3}"],
            "plan", ["trainer.mesh does not fit 8 devices: the fixed axes (model=3) need a multiple of 3 devices"],
        ),
        "override-key": (
            ["train", "--config_path", q, "--trainr.id", "x"], "train",
            ["command line: unknown key --trainr.id: expected one of corpus, data,", "did you mean --trainer.id?"],
        ),
        "file-key": (
            ["eval", "--config_path", str(w / "typo_key.yaml"), "--checkpoint", ckpt], "eval",
            ["typo_key.yaml: unknown key 'optimiser'", "did you mean optimizer?"],
        ),
        "sweep-option": (
            ["sweep", "--config_path", str(ROOT / "configs/finetune/quickstart_lora.yaml"), "--depth", "2"], "sweep",
            ["unknown key --depth:", "did you mean --depths?"],
        ),
        "generate-existing-output": (
            ["generate", "--config_path", q, "--checkpoint", missing, "--prompt", "x", "--output_jsonl", str(w / "a.txt")],
            "generate", [f"--output_jsonl={str(w / 'a.txt')!r} exists: pass --overwrite"],
        ),
        "plan-hlo-into-the-repository": (
            ["plan", "--config_path", q, "--target", "H200", "--save_hlo", str(ROOT / "docs" / "x.hlo"), "--overwrite"],
            "plan", ["is inside the repository's shipped folder docs/"],
        ),
        "export-into-the-repository": (
            ["export", "--config_path", q, "--checkpoint", missing, "--output", str(ROOT / "configs" / "exp")],
            "export", ["--output=", "is inside the repository's shipped folder configs/"],
        ),
        "bench-out-dir-into-the-repository": (
            ["bench", "compare", "x.yaml", "--out_dir", str(ROOT / "benchmarks" / "results" / "x")], "bench",
            ["is inside the repository's shipped folder benchmarks/"],
        ),
        "bench-mode": (["bench", "sped"], "bench", ["unknown bench mode 'sped'", "did you mean speed?"]),
        "analysis": (["analyze", "spectrum", "--output", "x"], "analyze", ["unknown analysis 'spectrum'", "did you mean spectra?"]),
    }  # fmt: skip


@pytest.fixture(scope="module")
def answered(files):
    """Every --help and every refusal of `refusals`, run in one fresh process."""
    helps = [[*command.split(), "--help"] for command in early.table()["help"]]
    cases = refusals(files)
    results = _in_one_process([*helps, ["--version"], *(argv for argv, _, _ in cases.values())], ROOT)
    return dict(zip([" ".join(h) for h in helps] + ["--version", *cases], results, strict=True))


def test_help_and_refusals_import_none_of_the_stack(answered):
    """The testable form of "answers at once": nothing heavy was imported for any of them."""
    imported = {case: r["heavy"] for case, r in answered.items() if r["heavy"]}
    assert not imported, imported


@pytest.mark.parametrize("command", sorted(early.table()["help"]))
def test_every_command_prints_its_help(answered, command):
    r = answered[f"{command} --help"]
    assert r["rc"] == 0 and r["err"] == "" and r["out"] == early.table()["help"][command]
    assert r["out"].startswith(f"usage: qkvflow {command}") or command == "bench", r["out"][:200]


@pytest.mark.parametrize("case", sorted(refusals(Path("w"))))
def test_each_refusal_is_one_line_naming_the_value(answered, case, files):
    _, verb, needles = refusals(files)[case]
    r = answered[case]
    assert r["rc"] == 2 and r["out"] == "", r
    assert r["err"].count("\n") == 1 and r["err"].endswith("\n"), r["err"]
    assert r["err"].startswith(f"qkvflow {verb}: error: " if verb else "qkvflow: error: "), r["err"]
    for needle in needles:
        assert needle in r["err"], r["err"]


def test_version_is_the_packages(answered):
    """`qkvflow --version` prints the version pyproject.toml declares (qkvflow.__version__ repeats it)."""
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert answered["--version"]["out"] == f"qkvflow {declared}\n" and answered["--version"]["rc"] == 0


def test_the_table_is_what_the_code_renders_now():
    """table.json holds each command's help and the registered model types as the code gives them now
    (in a fresh process: other tests register model types of their own)."""
    done = subprocess.run(
        [sys.executable, "-m", "qkvflow.cli.startup.table", "--check"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=LIMIT,
    )
    assert done.returncode == 0, done.stderr[-3000:]


def test_did_you_mean():
    assert early.did_you_mean("trian", ["train", "eval"]) == "; did you mean train?"
    assert early.did_you_mean("a100", ["H100-80GB", "A100-80GB"]) == "; did you mean A100-80GB?"  # a prefix, any case
    assert early.did_you_mean("zzz", ["train", "eval"]) == ""


def test_the_mesh_rule_follows_levanter():
    """`check_mesh` refuses only meshes that Levanter's MeshConfig.axis_shapes refuses for every split of
    the devices into slices, and uses Levanter's default axes."""
    from levanter.utils import mesh
    from levanter.utils.mesh import MeshConfig

    from qkvflow.errors import UserError

    assert early.ICI_DEFAULT == mesh.DEFAULT_ICI_AXIS_SPEC and early.DCN_DEFAULT == mesh.DEFAULT_DCN_AXIS_SPEC
    axes_cases = [None, {"model": 2}, {"model": 3}, {"data": 2, "model": 2}, {"data": -1, "model": 4},
                  {"data": 4, "replica": 1, "model": 1}, {"replica": -1, "model": 2}, {"data": -1, "replica": -1}]  # fmt: skip
    dcn_cases = [None, {"replica_dcn": 2}, {"replica_dcn": 1, "data": 2}, {"replica_dcn": -1}]
    refused = 0
    for ici in axes_cases:
        for dcn in dcn_cases:
            for devices in (1, 2, 3, 4, 6, 8, 16):
                config = MeshConfig(**({"axes": ici} if ici is not None else {}), **({"dcn_axes": dcn} if dcn else {}))
                levanter_takes = []
                for slices in [s for s in range(1, devices + 1) if devices % s == 0]:
                    try:
                        config.axis_shapes(devices, slices)
                        levanter_takes.append(slices)
                    except ValueError:
                        pass
                try:
                    early.check_mesh((ici, dcn), devices)
                except UserError:
                    refused += 1
                    assert not levanter_takes, (ici, dcn, devices, levanter_takes)
    assert refused >= 20  # the rule refuses something


def test_sigint_during_a_plan_ends_it_with_one_line_and_130():
    """Ctrl-C while `qkvflow plan` imports, traces or compiles: exit status 130, one line, no traceback,
    nothing on stdout. The signal is sent once the process has loaded jaxlib (its work has begun)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "qkvflow", "plan", "--config_path", TINY_PLAN, "--target", "cpu:1"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        _wait_for(lambda: proc.poll() is not None or "jaxlib" in Path(f"/proc/{proc.pid}/maps").read_text())
        assert proc.poll() is None, "the plan ended before the test could interrupt it"
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=LIMIT)
    finally:
        proc.kill()
    assert (proc.returncode, out, err) == (130, "", "qkvflow plan: interrupted (Ctrl-C)\n")


def test_sigint_unwinds_a_verb_with_one_line_and_130(tmp_path):
    """A verb blocked in its work (`bench depth` reading a report from a pipe nobody writes) ends on
    Ctrl-C with one line and 130, through KeyboardInterrupt (its output folder is not created)."""
    report = tmp_path / "report_depth.json"
    os.mkfifo(report)
    proc = subprocess.Popen(
        [sys.executable, "-m", "qkvflow", "bench", "depth", str(report), "--out_dir", str(tmp_path / "out")],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    writer = None
    try:
        writer = _wait_for(lambda: _open_writer(report) if proc.poll() is None else "ended")  # the verb is reading
        assert proc.poll() is None, proc.communicate()
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=LIMIT)
    finally:
        proc.kill()
        if isinstance(writer, int):
            os.close(writer)
    assert (proc.returncode, out, err) == (130, "", "qkvflow bench: interrupted (Ctrl-C)\n")
    assert not (tmp_path / "out").exists()


def test_sigint_ends_an_at_once_block_that_never_returns_to_python():
    """`interrupt.at_once`: a SIGINT ends the process while the main thread stays in a call that resumes
    after signals (as XLA's compiler does not return to Python): without the watching thread, the
    sleep below would outlast the test's limit."""
    script = (
        "import time\nfrom qkvflow.cli.startup import interrupt\n"
        "with interrupt.at_once('plan'):\n    print('ready', flush=True)\n    time.sleep(3 * 600)\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", script], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout.readline() == "ready\n"
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=LIMIT)
    finally:
        proc.kill()
    assert (proc.returncode, err) == (130, "qkvflow plan: interrupted (Ctrl-C)\n")


def _open_writer(path: Path):
    """A write end of the pipe at `path` once a reader has it open (O_NONBLOCK: ENXIO before), else None."""
    try:
        return os.open(path, os.O_WRONLY | os.O_NONBLOCK)
    except OSError:
        return None


def _wait_for(condition, limit: float = LIMIT):
    start = time.monotonic()
    while time.monotonic() - start < limit:
        value = condition()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"still waiting after {limit} s")


def test_the_plan_verb_itself_refuses_zero_devices():
    """Behind the seam, `qkvflow.cli.plan` refuses --devices 0 too (it once read 0 as 1)."""
    from qkvflow.cli import plan
    from qkvflow.errors import UserError

    with pytest.raises(UserError, match="--devices 0 is invalid: expected an integer >= 1"):
        plan.main(["--config_path", str(ROOT / Q), "--target", "H200", "--devices", "0"])
