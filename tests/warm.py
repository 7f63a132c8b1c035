"""`python -m qkvflow ARGS` for tests, forked from a warm interpreter.

Every `qkvflow` process a test starts spends ~10 s of the 2-core CI machine importing Levanter,
transformers and torch before it does anything (`python -X importtime -c "import levanter"`). Here a
server process per test process imports them once (the standard library's forkserver, with those
modules preloaded) and forks a child per command line: a real process with its own pid, signals, exit
status, environment, working folder and stdout/stderr files, that skips those imports.

What it does not reproduce is a fresh interpreter's import of those modules, so the suite keeps real
subprocesses where that is what a test checks (`tests/test_cli.py`, the launchers). Code under test that
starts `python -m qkvflow` itself with `subprocess.run` (`bench compare`) is given `Subprocess`. A
command line whose environment differs from the server's in a variable that is read at import time
(`IMPORT_TIME`, e.g. JAX_ENABLE_X64) runs as an ordinary subprocess; the few such variables the tests
set (EQX_ON_ERROR, TRANSFORMERS_VERBOSITY) are applied in the child instead (`AFTER_FORK`).
The server starts before any XLA backend exists in it, so the fork is safe for JAX.
`QKVFLOW_TESTS_WARM=0 pytest ...` starts every command line in a new interpreter instead.
"""

import atexit
import importlib
import io
import multiprocessing
import os
import signal
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

# Imported once in the server: what `qkvflow train | eval | finetune | generate | export` import.
PRELOAD = [
    "qkvflow.cli",
    "qkvflow.cli.train",
    "qkvflow.training.loop",
    "qkvflow.training.session",
    "qkvflow.finetune.run",
    "qkvflow.data.corpora",
    "qkvflow.models",
    "levanter.trainer",
    "levanter.checkpoint",
    "transformers",
    "matplotlib.pyplot",  # the loss curve and depth plots (~0.7 s of a run that plots: `python -X importtime`)
]
# Read after the fork (at XLA's backend start or by qkvflow while it runs), so a child may set its own;
# EQX_ON_ERROR and TRANSFORMERS_VERBOSITY are read when equinox and transformers are imported, and
# `_child` sets the values they then keep. pytest sets PYTEST_CURRENT_TEST to each test's name.
AFTER_FORK = {"XLA_FLAGS", "PYTHONUNBUFFERED", "QKVFLOW_TEST_INJECT_NONFINITE", "QKVFLOW_ATTENTION", "EQX_ON_ERROR",
              "TRANSFORMERS_VERBOSITY", "PYTEST_CURRENT_TEST"}  # fmt: skip
# Prefixes of variables that Python, JAX, equinox, Levanter, transformers or torch read when imported. A
# child gets a new interpreter when one of these, or a variable the server started with, differs; one
# that imports in this process added later (torch's KMP_*, Levanter's logging set-up) does not count.
IMPORT_TIME = ("PYTHON", "JAX", "XLA_PYTHON", "EQX_", "TF_", "HF_", "TRANSFORMERS_", "TORCH_", "USE_TORCH", "USE_TF",
               "LEVANTER", "HALIAX", "WANDB_", "OMP_", "MKL_", "LD_", "CUDA", "TPU_")  # fmt: skip
MAIN = "qkvflow.cli:main"  # what `python -m qkvflow` runs

_server: dict = {}  # "context" and "environ": the forkserver and the environment it started with


def _context():
    if "context" not in _server:
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload(PRELOAD)
        _server.update(context=context, environ=dict(os.environ))
    return _server["context"]


def _forkable(env: dict) -> bool:
    if os.environ.get("QKVFLOW_TESTS_WARM") == "0":  # every command line in a new interpreter, as before
        return False
    _context()
    started = _server["environ"]
    changed = {k for k in set(env) | set(started) if env.get(k) != started.get(k)} - AFTER_FORK
    return not any(k in started or k.startswith(IMPORT_TIME) for k in changed)


def _child(entry, argv, env, cwd, stdout_path, stderr_path):
    """In the forked child: the environment, folder and output files of the command line, then
    `entry(argv)` (`python -m qkvflow` by default), ending as the interpreter would (atexit hooks; an
    uncaught Ctrl-C re-raised as SIGINT, as CPython exits on one)."""
    os.environ.clear()
    os.environ.update(env)
    if "equinox" in sys.modules:  # equinox read the server's EQX_ON_ERROR (unset: "raise") when imported
        import equinox._errors

        equinox._errors.EQX_ON_ERROR = env.get("EQX_ON_ERROR", "raise")
    if "transformers" in sys.modules:  # read once, when transformers configured its logger in the server
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity(hf_logging.log_levels[env.get("TRANSFORMERS_VERBOSITY", "warning")])
    os.chdir(cwd)
    for fd, path in ((1, stdout_path), (2, stderr_path)):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        os.dup2(target, fd)
        os.close(target)
    unbuffered = bool(env.get("PYTHONUNBUFFERED"))
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), line_buffering=True, write_through=unbuffered)
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), line_buffering=True, write_through=True)
    sys.__stdout__, sys.__stderr__ = sys.stdout, sys.stderr
    sys.argv = [str(Path(__file__).resolve().parents[1] / "qkvflow" / "__main__.py"), *argv]
    module, name = entry.split(":")
    main = getattr(importlib.import_module(module), name)
    try:
        code = main(argv)
    except SystemExit as e:
        code = e.code
    except BaseException as e:
        traceback.print_exc()
        atexit._run_exitfuncs()
        if isinstance(e, KeyboardInterrupt):
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)
        os._exit(1)
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    sys.exit(code)


class Process:
    """The part of `subprocess.Popen` the tests use, for a child of the warm server (its stdout and
    stderr go to files: `stdout_path`, `stderr_path`)."""

    def __init__(self, argv, env: dict, cwd, stdout_path, stderr_path, entry: str = MAIN, append: bool = False):
        self.args = [entry, *argv]
        self.stdout_path, self.stderr_path = Path(stdout_path), Path(stderr_path)
        for path in (self.stdout_path, self.stderr_path):
            if not append:
                path.write_text("")
        self._process = _context().Process(
            target=_child, args=(entry, list(argv), dict(env), str(cwd), str(stdout_path), str(stderr_path))
        )
        self._process.start()
        self.pid = self._process.pid

    @property
    def returncode(self):
        return self._process.exitcode

    def poll(self):
        return self._process.exitcode

    def wait(self, timeout=None):
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self._process.exitcode

    def send_signal(self, sig):
        if self._process.exitcode is None:
            os.kill(self.pid, sig)

    def kill(self):
        self.send_signal(signal.SIGKILL)


def _command(entry: str, argv) -> list[str]:
    """The same as a fresh interpreter's command line."""
    if entry == MAIN:
        return [sys.executable, "-m", "qkvflow", *argv]
    module, name = entry.split(":")
    root = str(Path(__file__).resolve().parents[1])
    code = f"import sys; sys.path.insert(0, {root!r}); from {module} import {name}; sys.exit({name}(sys.argv[1:]))"
    return [sys.executable, "-c", code, *argv]


def popen(argv, env: dict, cwd, stdout_path, stderr_path, entry: str = MAIN):
    """`entry(argv)` (`python -m qkvflow *argv` by default; else "module:function") started with `env` in
    `cwd`, writing to the two files: a warm child when `env` allows one (see the module's docstring), else
    a subprocess."""
    if _forkable(env):
        return Process(argv, env, cwd, stdout_path, stderr_path, entry)
    with open(stdout_path, "w") as out, open(stderr_path, "w") as err:
        return subprocess.Popen(_command(entry, argv), cwd=cwd, env=env, stdout=out, stderr=err)


def run(argv, env: dict, cwd, timeout=None, entry: str = MAIN) -> subprocess.CompletedProcess:
    """Like `subprocess.run([sys.executable, "-m", "qkvflow", *argv], capture_output=True, text=True)`."""
    with tempfile.TemporaryDirectory(prefix="qkvflow-warm-") as folder:
        out, err = Path(folder, "stdout"), Path(folder, "stderr")
        proc = popen(argv, env, cwd, out, err, entry)
        try:
            code = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise
        return subprocess.CompletedProcess(proc.args, code, out.read_text(), err.read_text())


def exec_code(argv) -> int:
    """An `entry` that runs the Python source `argv[0]` as `python -c` would (`sys.argv[1:]` the rest)."""
    sys.argv = ["-c", *argv[1:]]
    exec(compile(argv[0], "<string>", "exec"), {"__name__": "__main__"})
    return 0


class Subprocess:
    """A stand-in for the `subprocess` module of code that runs `python -m qkvflow ...` as
    `subprocess.run(cmd, cwd=..., env=..., stdout=LOG, stderr=subprocess.STDOUT, timeout=...)` or
    `subprocess.Popen(...)` alike, with LOG an open file (`qkvflow bench compare`'s trainings and
    evaluations, through its task pool): such a command line runs through `run` or `popen` (a warm child when
    its environment allows; it stays in the server's process group), its output appended to LOG; any other
    call goes to the real module. `verbs` lists the verbs it ran so."""

    STDOUT, PIPE, DEVNULL, CompletedProcess, TimeoutExpired = (subprocess.STDOUT, subprocess.PIPE,
        subprocess.DEVNULL, subprocess.CompletedProcess, subprocess.TimeoutExpired)  # fmt: skip

    def __init__(self):
        self.verbs: list[str] = []

    def run(self, cmd, *, cwd=None, env=None, stdout=None, stderr=None, timeout=None, **kwargs):
        ours = list(cmd[:3]) == [sys.executable, "-m", "qkvflow"] and stderr == subprocess.STDOUT
        if not ours or kwargs or not hasattr(stdout, "write"):
            return subprocess.run(cmd, cwd=cwd, env=env, stdout=stdout, stderr=stderr, timeout=timeout, **kwargs)
        self.verbs.append(cmd[3])
        proc = run(list(cmd[3:]), dict(os.environ if env is None else env), cwd or os.getcwd(), timeout)
        stdout.write(proc.stdout + proc.stderr)
        stdout.flush()
        return subprocess.CompletedProcess(list(cmd), proc.returncode)

    def Popen(self, cmd, *, cwd=None, env=None, stdout=None, stderr=None, **kwargs):  # noqa: N802 (subprocess's name)
        ours = list(cmd[:3]) == [sys.executable, "-m", "qkvflow"] and stderr == subprocess.STDOUT
        env = dict(os.environ if env is None else env)
        if not ours or not hasattr(stdout, "name") or not _forkable(env):
            return subprocess.Popen(cmd, cwd=cwd, env=env, stdout=stdout, stderr=stderr, **kwargs)
        self.verbs.append(cmd[3])
        stdout.flush()
        return Process(list(cmd[3:]), env, cwd or os.getcwd(), stdout.name, stdout.name, append=True)
