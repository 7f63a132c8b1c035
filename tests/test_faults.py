"""Faults during `qkvflow train`: SIGKILL at random moments and during a checkpoint write, SIGTERM
(preemption), SIGINT (Ctrl-C), and non-finite steps. See qkvflow/training/faults.py for what the trainer does about each.

Speed: every process here shares one JAX compilation cache (possible because EQX_ON_ERROR=nan turns
Equinox's runtime checks, host callbacks that would make the step uncacheable, into NaNs; the
tiny model never trips them), and skips evaluation (tiny_train.yaml already turns off Levanter's
jaxpr/HLO logging and its parameter watching). None of this changes the arithmetic of a step.
"""

import json
import os
import random
import signal
import time
from pathlib import Path

import equinox as eqx
import jax
import pytest

from qkvflow.training.faults import incomplete_checkpoints
from tests import warm
from tests.timescale import limit
from tests.train_utils import cli_in_one_process, losses, reference_run, train_args, train_env

INTERVAL = 2  # trainer.checkpointer.keep: [{every: 2}]
FAST = [
    "--loss_curve",
    "null",
    "--trainer.max_eval_batches",
    "0",  # no evaluation: not what these tests are about
    "--trainer.checkpointer.keep",
    f"[{{every: {INTERVAL}}}]",
]


@pytest.fixture(scope="module")
def jax_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("jax_cache")


RUN_LIMIT = limit(600)
"""Seconds a training run of these tests may take (tests/timescale.py)."""


class Run:
    """`qkvflow train` in a subprocess that a test can signal while it runs."""

    count = 0

    def __init__(self, workdir: Path, corpus_root: Path, jax_cache: Path, *overrides: str, env=None, run_id="tiny"):
        Run.count += 1
        self.workdir = workdir
        self.stdout_path = workdir / f"run{Run.count}.out"
        self.stderr_path = workdir / f"run{Run.count}.err"
        environ = train_env(1, EQX_ON_ERROR="nan")
        environ.update(env or {})
        args = train_args(
            workdir,
            corpus_root,
            "--trainer.jax_compilation_cache_dir",
            str(jax_cache),
            *FAST,
            *overrides,
            run_id=run_id,
        )
        self.proc = warm.popen(args[3:], environ, workdir, self.stdout_path, self.stderr_path)

    @property
    def stdout(self) -> str:
        return self.stdout_path.read_text()

    @property
    def stderr(self) -> str:
        return self.stderr_path.read_text()

    def steps_done(self) -> int:
        """The last step printed as `step N/M` (each is printed once it is done)."""
        done = [int(line.split()[1].split("/")[0]) for line in self.stdout.splitlines() if line.startswith("step ")]
        return max(done, default=0)

    def wait_for(self, condition, timeout=RUN_LIMIT, poll=0.005) -> bool:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if condition():
                return True
            if self.proc.poll() is not None:
                return condition()
            time.sleep(poll)
        raise AssertionError(f"timed out; stdout:\n{self.stdout[-2000:]}\nstderr:\n{self.stderr[-2000:]}")

    def finish(self, timeout=RUN_LIMIT) -> int:
        try:
            return self.proc.wait(timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()

    def describe(self) -> str:
        return f"rc={self.proc.returncode}\nstdout:\n{self.stdout[-3000:]}\nstderr:\n{self.stderr[-3000:]}"


def _step_dirs(workdir: Path, run_id="tiny") -> dict[str, bool]:
    """step-N folder -> whether it has a readable metadata.json."""
    root = workdir / "checkpoints" / run_id
    out = {}
    for d in sorted(root.glob("step-*")) if root.is_dir() else []:
        try:
            json.loads((d / "metadata.json").read_text())
            out[d.name] = True
        except (FileNotFoundError, json.JSONDecodeError):
            out[d.name] = False
    return out


def _resumed_from(run: Run) -> int:
    for line in run.stdout.splitlines():
        if line.startswith("resuming run"):
            return int(line.split()[-1])
    return 0


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The losses of an uninterrupted 8-step run of the same config: the session's shared reference run
    (tests/train_utils.py, which test_train trains too), read when called, so that a test asks for it
    once its own runs are done and the other test process has usually trained it by then. That run
    evaluates and keeps Equinox's runtime checks; neither changes a training step's arithmetic, so its
    losses equal these runs' bit for bit."""

    def curve() -> list[float]:
        _, workdir, proc = reference_run(tmp_path_factory)
        assert proc.returncode == 0, proc.stderr[-3000:]
        found = losses(workdir)
        assert len(found) == 8
        return found

    return curve


def _kill_at_random(workdir, corpus_root, jax_cache, rng, latest=3) -> tuple[Run, int]:
    """SIGKILL once a random number of steps (2 to `latest`) is done, plus a random delay of up to one
    step's time (measured: the time from the first step's line to the second's); returns the run and the
    last step it finished. A fixed delay would land steps later once steps get faster, and leave the
    SIGTERM and SIGINT runs after it no steps to interrupt."""
    run = Run(workdir, corpus_root, jax_cache)
    after = rng.randint(2, latest)
    fraction = rng.uniform(0.0, 1.0)
    run.wait_for(lambda: run.steps_done() >= 1)
    first = time.monotonic()
    run.wait_for(lambda: run.steps_done() >= 2)
    delay = fraction * (time.monotonic() - first)
    run.wait_for(lambda: run.steps_done() >= after)
    time.sleep(delay)
    run.proc.send_signal(signal.SIGKILL)
    run.finish()
    return run, run.steps_done()


def _kill_during_checkpoint_write(workdir, corpus_root, jax_cache) -> tuple[Run, str]:
    """SIGKILL as soon as a new step-N folder appears, before its metadata.json (written last)."""
    before = set(_step_dirs(workdir))
    run = Run(workdir, corpus_root, jax_cache)
    new = lambda: [d for d, complete in _step_dirs(workdir).items() if d not in before and not complete]  # noqa: E731
    run.wait_for(lambda: bool(new()), poll=0.002)
    run.proc.send_signal(signal.SIGKILL)
    run.finish()
    partial = new()
    assert partial, f"the kill came after the checkpoint write finished: {_step_dirs(workdir)}\n{run.describe()}"
    return run, partial[0]


def test_kills_and_preemption_resume_to_the_uninterrupted_losses(tmp_path, corpus_root, jax_cache, reference):
    """SIGKILL at a random step, SIGKILL during a checkpoint write, SIGTERM, SIGINT, then a run to the
    end: the per-step losses equal an uninterrupted run's exactly, each resume loses at most one
    checkpoint interval, metrics.jsonl holds each step once, and no half-written checkpoint folder
    is left."""
    rng = random.Random(1234)

    killed, done = _kill_at_random(tmp_path, corpus_root, jax_cache, rng)
    assert killed.proc.returncode == -signal.SIGKILL

    mid_write, partial = _kill_during_checkpoint_write(tmp_path, corpus_root, jax_cache)
    resumed = _resumed_from(mid_write)
    assert done - resumed <= INTERVAL + 1, (done, resumed)
    done = mid_write.steps_done()

    # SIGTERM: finish the step, save, exit 0, within a bounded time
    preempted = Run(tmp_path, corpus_root, jax_cache)
    preempted.wait_for(lambda: preempted.steps_done() > 0)
    sent = time.monotonic()
    preempted.proc.send_signal(signal.SIGTERM)
    assert preempted.finish(timeout=limit(120)) == 0, preempted.describe()
    elapsed = time.monotonic() - sent
    assert elapsed < limit(60), elapsed
    assert f"removing incomplete checkpoint {tmp_path / 'checkpoints' / 'tiny' / partial}" in preempted.stderr
    assert "stopped by SIGTERM after step" in preempted.stderr, preempted.describe()
    assert done - _resumed_from(preempted) <= INTERVAL + 1
    stopped_at = preempted.steps_done()
    assert stopped_at < 8, "SIGTERM came too late to test anything"
    assert _step_dirs(tmp_path).get(f"step-{stopped_at}") is True, _step_dirs(tmp_path)

    # Ctrl-C (SIGINT): the same, exiting 130 (128 + SIGINT, as a shell reports Ctrl-C)
    interrupted = Run(tmp_path, corpus_root, jax_cache)
    interrupted.wait_for(lambda: interrupted.steps_done() > stopped_at)
    interrupted.proc.send_signal(signal.SIGINT)
    assert interrupted.finish(timeout=limit(120)) == 130, interrupted.describe()
    assert _resumed_from(interrupted) == stopped_at  # SIGTERM lost nothing
    assert "KeyboardInterrupt" not in interrupted.stderr and "Traceback" not in interrupted.stderr
    assert "stopped by SIGINT after step" in interrupted.stderr, interrupted.describe()
    stopped_at = interrupted.steps_done()
    assert stopped_at < 8, "SIGINT came too late to test anything"

    final = Run(tmp_path, corpus_root, jax_cache)
    assert final.finish() == 0, final.describe()
    assert _resumed_from(final) == stopped_at  # SIGINT lost nothing
    assert f"step {stopped_at}/8" not in final.stdout and f"step {stopped_at + 1}/8" in final.stdout

    # each step once in the file itself: a resume drops what it trains again (the SIGKILLs' lost steps)
    raw = (tmp_path / "runs" / "tiny" / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in raw]
    assert [r["step"] for r in records if r["event"] == "log" and "train/loss" in r["metrics"]] == list(range(8))
    assert losses(tmp_path) == reference()
    assert incomplete_checkpoints(str(tmp_path / "checkpoints" / "tiny")) == []
    assert all(_step_dirs(tmp_path).values()), _step_dirs(tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_many_random_kills(tmp_path, corpus_root, jax_cache, reference, seed):
    """Like the test above with four random SIGKILLs in a row (several minutes)."""
    rng = random.Random(seed)
    for _ in range(4):
        run, done = _kill_at_random(tmp_path, corpus_root, jax_cache, rng, latest=6)
        if run.proc.returncode == 0:
            break
        assert done - _resumed_from(run) <= INTERVAL + 1
    final = Run(tmp_path, corpus_root, jax_cache)
    assert final.finish() == 0, final.describe()
    assert losses(tmp_path) == reference()
    assert incomplete_checkpoints(str(tmp_path / "checkpoints" / "tiny")) == []


# Both non-finite runs poison the same step the same way, so they share one compiled train step; they
# also share one process (tests/train_utils.cli_in_one_process), which saves one start-up.
POISON = {"QKVFLOW_TEST_INJECT_NONFINITE": "3:grad:projections.w2"}


@pytest.fixture(scope="module")
def nonfinite_runs(tmp_path_factory, corpus_root, jax_cache):
    """{"stop" | "skip": (work folder, exit code, stdout, stderr)} of the poisoned run in each mode."""
    cases, folders = {}, {}
    for case, extra in {"stop": [], "skip": ["--nonfinite", "skip", "--stop_after", "5"]}.items():
        folders[case] = tmp_path_factory.mktemp(f"nonfinite-{case}")
        args = train_args(
            folders[case], corpus_root, "--trainer.jax_compilation_cache_dir", str(jax_cache), *FAST, *extra
        )
        cases[case] = args[3:]  # after `python -m qkvflow`
    results = cli_in_one_process(cases, train_env(1, EQX_ON_ERROR="nan", **POISON), cwd=tmp_path_factory.getbasetemp())
    return {case: (folders[case], *results[case]) for case in cases}


def test_nonfinite_gradient_stops_naming_step_and_parameter(nonfinite_runs):
    workdir, code, stdout, stderr = nonfinite_runs["stop"]
    assert code == 3, stdout[-3000:] + stderr[-3000:]
    error = [line for line in stderr.splitlines() if line.startswith("qkvflow train: error:")]
    assert len(error) == 1, stderr[-3000:]
    assert "non-finite values at step 3/8: first in the gradients" in error[0]
    assert "generator.projections.w2 (1 of" in error[0]
    assert "Traceback" not in stderr
    assert "step 2/8" in stdout and "step 3/8" not in stdout
    # no checkpoint of the poisoned step or later (Levanter runs the checkpointer from step 3 on)
    assert _step_dirs(workdir) == {}
    assert len(losses(workdir)) == 2


def test_nonfinite_step_is_skipped_in_skip_mode(nonfinite_runs):
    workdir, code, stdout, stderr = nonfinite_runs["skip"]
    assert code == 0, stdout[-3000:] + stderr[-3000:]
    assert "skipped step 3: non-finite values at step 3/8: first in the gradients" in stderr
    assert "skipped_steps: [3]" in stdout
    assert "Global tracker is already set" not in stderr  # the second run in this process (as in a sweep)
    curve = losses(workdir)
    assert len(curve) == 5 and all(c == c for c in curve)  # step 3's loss is finite: only w2's gradient was poisoned
    assert _step_dirs(workdir) == {"step-4": True, "step-5": True}  # every 2 steps from step 3 on, and the last


# --- in-process pieces ----------------------------------------------------------------------------


def test_report_names_where_nonfinite_values_first_appear():
    import jax.numpy as jnp
    import numpy as np

    from qkvflow.training.faults import _gradient_paths, describe_nonfinite
    from tests.helpers import tiny_config, tiny_model

    model = tiny_model(tiny_config())
    names = _gradient_paths(model)
    ok = np.ones(len(names), bool)
    one_bad = ok.copy()
    one_bad[names.index("generator.projections.w2")] = False
    report = describe_nonfinite(model, 3.25, one_bad, 7, 10)
    assert report.startswith("non-finite values at step 7/10: first in the gradients (the loss 3.2500 is finite)")
    assert "generator.projections.w2 (1 of" in report
    assert "first in the loss" in describe_nonfinite(model, float("nan"), ~ok, 2, 10)
    import equinox as eqx

    poisoned = eqx.tree_at(
        lambda m: m.generator.projections["q+k+v"].array, model, model.generator.projections["q+k+v"].array * jnp.inf
    )
    report = describe_nonfinite(poisoned, float("nan"), ~ok, 2, 10)
    assert "first in the parameters: generator.projections.q+k+v" in report


class _Tiny(eqx.Module):
    w: jax.Array


def test_levanter_still_behaves_as_our_run_loop_assumes():
    """The run loop (qkvflow.training.loop) and the non-finite guard lean on four details of Levanter's
    Trainer; if one changes, this fails here instead of a run silently losing a guarantee."""
    import inspect

    import jax.numpy as jnp
    import jax.random as jrandom
    import optax
    from levanter.callbacks import StepInfo
    from levanter.trainer import Trainer, TrainerHooks
    from levanter.trainer_state import TrainerState

    from qkvflow.training.faults import GuardState, guard_nonfinite

    # we build the trainer without Levanter's default hooks, to order ours (guard before checkpointer)
    assert "add_default_hooks" in inspect.signature(Trainer.__init__).parameters

    # StepInfo.step is 0-based: the step just completed (state.step counts the updates made)
    state = TrainerState.init(guard_nonfinite(optax.sgd(0.5)), _Tiny(jnp.ones(3)), key=jrandom.PRNGKey(0))
    assert int(state.step) == 0

    # the loss reaches optimizer.update as `loss=` (TrainerState.take_step -> take_train_step): the
    # guard stops a step whose loss alone is NaN (finite gradients), and the step changes nothing
    grads = _Tiny(jnp.ones(3))
    bad, _ = state.take_step(grads, loss=jnp.array(jnp.nan), key=jrandom.PRNGKey(1))
    assert isinstance(bad.opt_state, GuardState) and not bool(bad.opt_state.finite)
    assert jnp.array_equal(bad.model.w, state.model.w)
    good, _ = bad.take_step(grads, loss=jnp.array(1.0), key=jrandom.PRNGKey(2))
    assert bool(good.opt_state.finite) and not jnp.array_equal(good.model.w, state.model.w)
    assert StepInfo(good, 1.0, 0.0).step == 1 and StepInfo(bad, 1.0, 0.0).step == 0
    # ... and the compiled train step passes its loss to take_step (no cheaper public way to see it)
    assert "loss=loss" in inspect.getsource(Trainer._train_step)

    # hooks run from the third step on (0-based step 2), or when forced: the loop itself calls what
    # must see steps 0 and 1 (the guard, the step metrics, progress, evaluation)
    seen = []
    hooks = TrainerHooks()
    hooks.add_hook(lambda info, force=False: seen.append((info.step, force)), every=1)
    infos = []
    s = state
    for _ in range(4):
        s, _ = s.take_step(grads, loss=jnp.array(1.0), key=jrandom.PRNGKey(3))
        infos.append(StepInfo(s, 1.0, 0.0))
    for info in infos:
        hooks.run_hooks(info)
    hooks.run_hooks(infos[0], force=True)
    assert seen == [(2, False), (3, False), (0, True)]


def test_loss_injection_poisons_the_loss_weights_of_one_step_only():
    """`K:loss` (tests only): the batch of step K (1-based), counted from the step a run resumes at,
    gets NaN loss weights, so that its forward pass gives a NaN loss; the other batches are untouched."""
    import haliax as hax
    import jax.numpy as jnp
    from levanter.models.lm_model import LmExample

    from qkvflow.training.faults import Injection, poison_loss

    Pos = hax.Axis("position", 4)
    batches = [LmExample.causal(hax.arange(Pos) + i) for i in range(4)]
    out = list(poison_loss(batches, start=2, inject=Injection(4, "loss")))  # steps 3..6 (1-based)
    poisoned = [bool(jnp.isnan(b.loss_weight.array).any()) for b in out]
    assert poisoned == [False, True, False, False]
    assert bool(jnp.isnan(out[1].loss_weight.array).all()) and out[1].tokens is batches[1].tokens
    assert all(a is b for a, b in zip(poison_loss(batches, 0, Injection(2, "w1")), batches))  # a gradient injection
    assert all(a is b for a, b in zip(poison_loss(batches, 0, None), batches))


def test_injection_spec(monkeypatch):
    from qkvflow.training.faults import INJECT_ENV, Injection

    monkeypatch.delenv(INJECT_ENV, raising=False)
    assert Injection.from_env() is None
    monkeypatch.setenv(INJECT_ENV, "5:grad:w1")
    assert Injection.from_env() == Injection(5, "w1")
    monkeypatch.setenv(INJECT_ENV, "2:loss")
    assert Injection.from_env() == Injection(2, "loss")
    monkeypatch.setenv(INJECT_ENV, "2:params")
    with pytest.raises(ValueError):
        Injection.from_env()


def _checkpoint_folder(run: Path, name: str, metadata=None) -> None:
    """What Levanter's checkpointer writes: one OCDBT store (`manifest.ocdbt`, data files under `d/`),
    then `metadata.json` last, once every process has committed (so None: a write killed before that)."""
    (run / name / "d").mkdir(parents=True)
    (run / name / "d" / "6920482fcb6b2218616c66d037bfee16").write_bytes(b"\0" * 64)
    (run / name / "manifest.ocdbt").write_bytes(b"\0" * 32)
    if metadata is not None:
        (run / name / "metadata.json").write_text(metadata)


def _meta(step, ts, temporary=False):
    return json.dumps({"step": step, "timestamp": ts, "is_temporary": temporary})


def test_incomplete_checkpoints_are_found_and_removed(tmp_path):
    import levanter.checkpoint

    from qkvflow.training.faults import remove_incomplete_checkpoints

    run = tmp_path / "run"
    _checkpoint_folder(run, "step-2", _meta(2, "2025-01-01T00:00:02"))
    _checkpoint_folder(
        run, "step-3", _meta(3, "2025-01-01T00:00:03", temporary=True)
    )  # superseded temporary checkpoint
    _checkpoint_folder(run, "step-4", _meta(4, "2025-01-01T00:00:04"))
    _checkpoint_folder(run, "step-6")  # killed before metadata.json
    _checkpoint_folder(run, "notes")  # not Levanter's: left alone
    expected = [str(run / n) for n in ("step-3", "step-6")]
    assert incomplete_checkpoints(str(run)) == expected
    assert (
        incomplete_checkpoints(str(run), superseded_temporary=False) == expected[1:]
    )  # delete_old_temp_checkpoints: false
    assert remove_incomplete_checkpoints(str(run)) == expected
    assert sorted(p.name for p in run.iterdir()) == ["notes", "step-2", "step-4"]
    assert levanter.checkpoint.discover_latest_checkpoint(str(run)) == str(run / "step-4")
    assert incomplete_checkpoints(str(tmp_path / "missing")) == []


def test_the_newest_checkpoint_is_kept_even_when_temporary(tmp_path):
    """The checkpoint a resume loads is never removed: here the newest is a temporary one, step-10, and
    its name sorts before step-9's (so the newest is found by step, as Levanter finds it, not by name);
    only the superseded temporary step-9 and the interrupted step-11 go."""
    import levanter.checkpoint

    from qkvflow.training.faults import remove_incomplete_checkpoints

    run = tmp_path / "run"
    _checkpoint_folder(run, "step-8", _meta(8, "2025-01-01T00:00:08"))
    _checkpoint_folder(run, "step-9", _meta(9, "2025-01-01T00:00:09", temporary=True))
    _checkpoint_folder(run, "step-10", _meta(10, "2025-01-01T00:00:10", temporary=True))
    _checkpoint_folder(run, "step-11")
    assert remove_incomplete_checkpoints(str(run)) == [str(run / "step-11"), str(run / "step-9")]
    assert sorted(p.name for p in run.iterdir()) == ["step-10", "step-8"]
    assert levanter.checkpoint.discover_latest_checkpoint(str(run)) == str(run / "step-10")


UNREADABLE = {
    "truncated": '{"step": garbage',
    "empty": "",
    "no-timestamp": '{"step": 8}',
    # Levanter passes over a folder whose timestamp is not ISO format or whose step is not an integer
    "bad-timestamp": '{"step": 8, "timestamp": "yesterday"}',
    "bad-step": '{"step": "eight", "timestamp": "2025-01-01T00:00:08"}',
    "not-a-dict": "[8]",
    "binary": b"\xff\xfe",
    # file-system states: a symbolic link to a file that is gone is there but cannot be opened (not an
    # interrupted write: Levanter writes metadata.json itself, never a link); a link to itself cannot be read
    "dangling-link": lambda file: os.symlink(file.parent / "gone.json", file),
    "link-loop": lambda file: os.symlink(file, file),
}


@pytest.mark.parametrize("metadata", list(UNREADABLE.values()), ids=list(UNREADABLE))
def test_unreadable_metadata_stops_the_run_and_removes_nothing(tmp_path, metadata):
    """A step-N folder whose metadata.json exists but cannot be read may hold a complete checkpoint:
    one line naming it and how to resume, and nothing removed (not even the interrupted step-6)."""
    from qkvflow.errors import UserError
    from qkvflow.training.faults import remove_incomplete_checkpoints

    run = tmp_path / "run"
    _checkpoint_folder(run, "step-4", _meta(4, "2025-01-01T00:00:04"))
    _checkpoint_folder(run, "step-6")
    _checkpoint_folder(run, "step-8")
    file = run / "step-8" / "metadata.json"
    if callable(metadata):
        metadata(file)
    else:
        file.write_bytes(metadata.encode() if isinstance(metadata, str) else metadata)
    before = {str(p): p.read_bytes() for p in run.rglob("*") if p.is_file()}
    with pytest.raises(UserError) as info:
        remove_incomplete_checkpoints(str(run))
    message = str(info.value)
    assert "\n" not in message and f"checkpoint {run / 'step-8'}: its metadata.json" in message
    assert f"mv {run / 'step-8'} {run}.step-8.unreadable" in message and "it was not removed" in message
    assert {str(p): p.read_bytes() for p in run.rglob("*") if p.is_file()} == before
    assert sorted(p.name for p in run.iterdir()) == ["step-4", "step-6", "step-8"] and os.path.lexists(file)


def test_ctrl_c_while_the_training_step_compiles_exits_130_at_once(tmp_path, corpus_root, jax_cache):
    """Ctrl-C once the run says it is compiling: nothing to finish or save, so the run ends at once (not
    after the compile and a step) with exit status 130 and one line, and leaves no checkpoint."""
    run = Run(tmp_path, corpus_root, jax_cache)
    run.wait_for(lambda: "compiling the training step" in run.stdout, timeout=limit(600))
    run.proc.send_signal(signal.SIGINT)
    assert run.finish(timeout=limit(60)) == 130, run.describe()
    assert run.stderr.splitlines()[-1] == "qkvflow train: stopped by SIGINT before the first step; nothing to save"
    assert "finishing the current step" not in run.stderr and "Traceback" not in run.stderr, run.describe()
    assert run.steps_done() == 0 and _step_dirs(tmp_path) == {}


def test_sigterm_requests_a_stop_after_the_current_batch():
    from qkvflow.training.faults import Preemption

    before = signal.getsignal(signal.SIGTERM)  # not necessarily SIG_DFL: other libraries install their own
    with Preemption() as preemption:
        batches = preemption.wrap(iter(range(10)))
        assert next(batches) == 0
        os.kill(os.getpid(), signal.SIGTERM)
        assert preemption.requested and preemption.signal_name == "SIGTERM"
        assert list(batches) == []
    assert signal.getsignal(signal.SIGTERM) is before


def test_sigint_requests_a_stop_and_a_second_one_exits_at_once(tmp_path):
    """Ctrl-C is a preemption too (no KeyboardInterrupt): the first SIGINT asks for a stop after the
    current step, with a message that says so; a second one ends the process at once."""
    import subprocess
    import sys

    from qkvflow.cli.train import stop_status
    from qkvflow.training.faults import Preemption

    before = signal.getsignal(signal.SIGINT)
    with Preemption() as preemption:
        batches = preemption.wrap(iter(range(10)))
        assert next(batches) == 0
        os.kill(os.getpid(), signal.SIGINT)
        assert preemption.requested and preemption.signal_name == "SIGINT"
        assert (
            stop_status({"stopped_by": preemption.signal_name}) == 130 and stop_status({"stopped_by": "SIGTERM"}) == 0
        )
        assert list(batches) == []
    assert signal.getsignal(signal.SIGINT) is before

    # a second SIGINT, and likewise a second SIGTERM, ends the process at once (the README's promise)
    for sig, again in ((signal.SIGINT, "press Ctrl-C again"), (signal.SIGTERM, "send SIGTERM again")):
        twice = (
            "import os, signal, time\n"
            "from qkvflow.training.faults import Preemption\n"
            "p = Preemption().install()\n"
            f"os.kill(os.getpid(), signal.{sig.name})\n"
            "print('first', p.requested, flush=True)\n"
            f"os.kill(os.getpid(), signal.{sig.name})\n"
            "time.sleep(30)\n"
            "print('survived the second', flush=True)\n"
        )
        proc = subprocess.run([sys.executable, "-c", twice], capture_output=True, text=True, timeout=limit(120))
        # ended by the signal's own action (the main thread's handler) or by the watcher thread's exit
        assert proc.returncode in (-sig, 128 + sig) and proc.stdout == "first True\n", (
            sig,
            proc.returncode,
            proc.stdout,
            proc.stderr,
        )
        message = f"{sig.name} received: finishing the current step, saving a checkpoint, then exiting ({again}"
        assert message in proc.stderr


def test_ctrl_c_under_jax_distributed_is_forwarded_as_one_sigterm(monkeypatch):
    """With several processes, the first SIGINT is passed on to JAX's preemption notifier as a SIGTERM to
    our own process, which is not a second signal. A faked two-process run (a distributed client,
    process_count 2) whose `os.kill` delivers as CPython does for a signal to itself: the handler runs
    inside the call (or the default action ends the process). The forwarded SIGTERM must find the
    flag set: one stop requested, by SIGINT, and the process alive (else it exits 143, unsaved)."""
    from qkvflow.training import faults
    from qkvflow.training import preemption as preemption_module

    died = []

    def deliver(pid, signum):
        assert pid == os.getpid()
        handler = signal.getsignal(signum)
        if handler is signal.SIG_DFL:  # the default action of SIGTERM and SIGINT: the process ends
            died.append(signal.Signals(signum).name)
        else:
            handler(signum, None)

    monkeypatch.setattr(preemption_module, "_distributed_client", lambda: object())
    monkeypatch.setattr(faults.jax, "process_count", lambda: 2)
    monkeypatch.setattr(faults.os, "kill", deliver)
    before = signal.getsignal(signal.SIGTERM)
    with faults.Preemption() as preemption:
        deliver(os.getpid(), signal.SIGINT)  # Ctrl-C
        assert died == [] and preemption.requested and preemption.signal_name == "SIGINT"
        assert not preemption._forwarded and signal.getsignal(signal.SIGTERM) == preemption._handle
        deliver(os.getpid(), signal.SIGINT)  # a second Ctrl-C still ends the process at once
        assert died == ["SIGINT"]
    assert signal.getsignal(signal.SIGTERM) is before


def test_a_resume_drops_the_metrics_of_the_steps_it_trains_again(tmp_path):
    """The file a SIGKILL leaves after step 5 (checkpoint after step 3, a line cut short): resuming at
    step 3 (0-based) keeps hparams, summaries and steps 0-2; Levanter's rerun of the hooks after the
    last step writes nothing twice."""
    from qkvflow.runs.tracking import JsonlTracker, drop_steps_from

    file = tmp_path / "runs" / "tiny" / "metrics.jsonl"
    tracker = JsonlTracker(str(file))
    tracker.log_hyperparameters({"lr": 0.1})
    for step in range(5):
        tracker.log({"train/loss": 5.0 - step}, step=step)
        tracker.log({"throughput/hook_time": 0.1}, step=step)
    tracker.log_summary({"parameter_count": 7})
    with open(file, "a") as f:
        f.write('{"event": "log", "step": 5, "metr')  # the kill
    assert drop_steps_from(str(file), 3) == 5
    records = [json.loads(line) for line in file.read_text().splitlines()]
    assert [r["event"] for r in records] == ["hparams"] + ["log"] * 6 + ["summary"]
    assert [r["step"] for r in records if r["event"] == "log"] == [0, 0, 1, 1, 2, 2]
    resumed = JsonlTracker(str(file))
    for step in (3, 4):
        resumed.log({"train/loss": 1.5, "global_step": step}, step=step)
        resumed.log({"eval/loss": 2.0}, step=step)
    resumed.log({"train/loss": 1.5, "global_step": 4}, step=4)  # the hooks again, after the last step
    resumed.log({"eval/loss": 2.0, "eval/bpb": 1.0}, step=4)  # a new metric of the same step is kept
    logged = [
        (r["step"], sorted(r["metrics"])) for r in map(json.loads, file.read_text().splitlines()) if r["event"] == "log"
    ]
    assert [s for s, m in logged if "train/loss" in m] == [0, 1, 2, 3, 4]
    assert logged[-1] == (4, ["eval/bpb", "eval/loss"])
    assert drop_steps_from(str(tmp_path / "missing.jsonl"), 3) == 0
