"""`qkvflow train` end to end: trains, evaluates, checkpoints, resumes exactly, shards, refuses bad input."""

import math
import os

import pytest

from qkvflow.runs.tracking import metrics_file, read_metrics
from tests.timescale import limit
from tests.train_utils import cli_in_one_process, losses, reference_run


def _ok(proc):
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


@pytest.fixture(scope="module")
def reference(tmp_path_factory, corpus_root):
    """One uninterrupted 8-step run on one device, shared by the tests that compare against it (and by
    test_faults: trained once per session)."""
    _, workdir, proc = reference_run(tmp_path_factory)
    return workdir, _ok(proc)


def test_the_terminal_shows_progress_evaluations_and_the_summary_only(reference):
    """Levanter's log lines (cache loading, tracing, checkpoint commits, INFO and benign warnings) go to the
    log file, not the terminal: stdout holds qkvflow's own lines, stderr nothing. With `log_every: 1` the
    8-step run prints 8 step lines; the quickstart's 300 steps at `log_every: 10` print 48 lines in all."""
    import re

    _, proc = reference
    ours = re.compile(
        r"(preparing (corpus|the token cache) .*|token cache ready \(\d+ s\)|compiling the training step .*"
        r"|still compiling after \d+ s .*"  # a loaded machine
        r"|step \d+/8  loss [\d.]+  ppl [\d.]+(  [\d,]+ tokens/s  ETA \d+m\d\ds)?|eval after step \d+: loss [\d.]+  ppl [\d.]+"
        r"|== qkvflow train: done ==| +\w+: .+|)$"
    )
    strays = [line for line in proc.stdout.splitlines() if not ours.match(line)]
    assert not strays, strays[:5]
    assert proc.stderr == "", proc.stderr[:2000]
    assert sum(line.startswith("step ") for line in proc.stdout.splitlines()) == 8


def test_trains_evaluates_checkpoints_and_plots(reference):
    tmp_path, proc = reference
    assert "step 8/8" in proc.stdout and "eval after step 8" in proc.stdout
    # the quiet first minute is explained on stdout, in order, before the first step
    lines = proc.stdout.splitlines()
    said = [next((i for i, line in enumerate(lines) if line.startswith(start)), None) for start in (
        "preparing corpus pydoc in", "preparing the token cache in", "compiling the training step", "step 1/8",
    )]  # fmt: skip
    assert None not in said and said == sorted(said), proc.stdout[:2000]
    # Levanter's log goes to logs/<run_id>.log (Levanter 1.2 alone writes logs/<run_id>.log.log)
    assert "Saving checkpoint" in (tmp_path / "logs" / "tiny.log").read_text()
    assert sorted(p.name for p in (tmp_path / "logs").iterdir() if p.is_file()) == ["tiny.log"]
    curve = losses(tmp_path)
    assert len(curve) == 8 and curve[-1] < curve[0] - 0.5, curve
    steps = read_metrics(metrics_file(str(tmp_path / "runs"), "tiny"))
    last = steps[max(steps)]
    assert last["eval/perplexity"] == pytest.approx(math.exp(last["eval/loss"]), rel=1e-6)
    assert last["train/ode_nfe"] == 2.0  # Euler, 2 steps
    assert "throughput/tokens_per_second" in last
    assert sorted(p.name for p in (tmp_path / "checkpoints" / "tiny").glob("step-*")) == ["step-8"]  # after step 8
    assert (tmp_path / "runs" / "tiny" / "loss_curve.png").stat().st_size > 10_000


def test_weight_decay_reaches_the_matrix_generators_only(reference):
    """The run's optimizer uses qkvflow's ODE decay mask (tests/test_weight_decay.py checks it parameter
    by parameter). Counted here from tiny_train.yaml: hidden 32, MLP 128, d_emb 8, 16 frequencies (33
    time features); per matrix, Proj holds d_emb x its entries and its time MLP 33 x 8 + 8 x 8 weights."""
    import json

    workdir, _ = reference
    events = [json.loads(line) for line in open(metrics_file(str(workdir / "runs"), "tiny"))]
    summary = {k: v for e in events if e.get("event") == "summary" for k, v in e["metrics"].items()}
    entries = 4 * 32 * 32 + 2 * 32 * 128  # Q, K, V, O; W1, W2
    assert summary["decayed_parameter_count"] == 8 * entries + 6 * (33 * 8 + 8 * 8)


# What the runs compared with the reference skip: evaluation (the reference evaluates every 4 steps; it does
# not change a training step's arithmetic) and the loss-curve plot.
NO_EVAL = ["--trainer.max_eval_batches", "0", "--loss_curve", "null"]


def test_stop_and_resume_reproduces_uninterrupted_losses(four_device_runs):
    """`--stop_after 4` stops after step 4 with a checkpoint of it, named step-4 like the printed step, and
    `qkvflow train` again (with other evaluation and checkpoint cadences, which a resume may change) resumes
    there ("after step 4": the state's own step count) and finishes. Run in the 4-device process on the default (FSDP) mesh, so the
    uninterrupted run to compare with is the "fsdp" case beside it: same mesh, same programs, so the losses
    must be equal bit for bit (same data order, same state, same arithmetic). test_faults resumes on one
    device after signals."""
    workdir, code, stdout, stderr, _ = four_device_runs["stop"]
    assert code == 0, stderr[-3000:]
    assert "step 4/8" in stdout and "step 5/8" not in stdout
    assert "== qkvflow train: stopped after step 4 of 8 (stop_after 4); run the same command without" in stdout
    _, code, stdout, stderr, _ = four_device_runs["resume"]
    # the stop's checkpoint of step 4 (the resume read it) and the resumed run's final one (the fixture ran both)
    assert sorted(p.name for p in (workdir / "checkpoints" / "tiny").glob("step-*")) == ["step-4", "step-8"]
    assert code == 0, stderr[-3000:]
    assert "resuming run tiny after step 4" in stdout
    assert "step 5/8" in stdout and "step 4/8" not in stdout and "== qkvflow train: done ==" in stdout
    whole = losses(four_device_runs["fsdp"][0])
    assert len(whole) == 8 and losses(workdir) == whole


def test_a_run_begun_with_float32_moments_resumes_in_float32(four_device_runs):
    """`hypernetwork_mu_dtype: auto` (the default) keeps the dtype the checkpoint stores: a run begun with
    float32 first moments resumes bit for bit as the uninterrupted float32 run, and its next checkpoint
    still stores float32; asking for bfloat16 on resume is refused in one line, before anything is written."""
    from qkvflow.runs.checkpoint_arrays import array_dtypes

    workdir, code, _, stderr, _ = four_device_runs["f32-as-bf16"]
    assert code == 2, stderr[-2000:]
    assert (
        stderr.strip()
        .splitlines()[-1]
        .endswith(
            f"hypernetwork_mu_dtype='bfloat16' but checkpoint '{workdir}/checkpoints/tiny/step-4' stores the first "
            "moments in float32: resume with hypernetwork_mu_dtype: auto (or float32), or start a new run (a new trainer.id)"
        )
    )
    _, code, stdout, stderr, _ = four_device_runs["f32-resume"]
    assert code == 0, stderr[-3000:]
    assert "resuming run tiny after step 4" in stdout
    whole = losses(four_device_runs["f32"][0])
    assert len(whole) == 8 and losses(workdir) == whole
    assert whole != losses(four_device_runs["fsdp"][0])  # the default run's bfloat16 moments do change the losses
    mu = {k: v for k, v in array_dtypes(str(workdir / "checkpoints/tiny/step-8")).items() if "/mu/" in k}
    assert {v for k, v in mu.items() if "/projections/" in k} == {"float32"}


def test_a_new_run_stores_the_projections_first_moments_in_bfloat16(four_device_runs):
    from qkvflow.runs.checkpoint_arrays import array_dtypes

    workdir = four_device_runs["resume"][0]
    stored = array_dtypes(str(workdir / "checkpoints/tiny/step-8"))
    mu = {k: v for k, v in stored.items() if "/mu/" in k}
    assert {v for k, v in mu.items() if "/projections/" in k} == {"bfloat16"}
    assert {v for k, v in mu.items() if "/projections/" not in k} == {"float32"}  # e.g. the time MLPs
    assert {v for k, v in stored.items() if "/nu/" in k} == {"float32"}


@pytest.fixture(scope="module")
def reruns(tmp_path_factory, reference):
    """Two copies of the finished reference run, each in a work folder of its own, and in one process: the
    same command again and one with another model and batch on the first ("again", "changed"), and the
    same command with `trainer.num_train_steps` 9 on the second ("extend"). {case: (work folder, exit
    code, stdout, stderr)}, and the bytes of the first copy's metrics.jsonl and loss curve before."""
    import shutil

    from tests.train_utils import train_args, train_env

    corpora, ref, _ = reference_run(tmp_path_factory)
    folders = {}
    for name in ("finished", "extended"):
        folders[name] = tmp_path_factory.mktemp(f"rerun-{name}")
        for part in ("checkpoints", "runs"):
            shutil.copytree(ref / part, folders[name] / part)
    run = folders["finished"] / "runs" / "tiny"
    before = {f: (run / f).read_bytes() for f in ("metrics.jsonl", "loss_curve.png")}
    same = ["--trainer.steps_per_eval", "4"]  # the reference run's own command
    cases = {
        "again": train_args(folders["finished"], corpora, *same)[3:],
        "changed": train_args(
            folders["finished"], corpora, *same, "--model.ode.num_steps", "4", "--trainer.train_batch_size", "16"
        )[3:],
        "extend": train_args(folders["extended"], corpora, *same, "--trainer.num_train_steps", "9")[3:],
    }
    results = cli_in_one_process(cases, train_env(1), cwd=tmp_path_factory.getbasetemp())
    workdir = {"again": folders["finished"], "changed": folders["finished"], "extend": folders["extended"]}
    return {case: (workdir[case], *results[case]) for case in cases}, before


def test_a_finished_run_run_again_writes_nothing(reruns):
    """The same command on a finished run says so in one line and exits 0 before anything starts: no
    evaluation appended to metrics.jsonl (each step once), the loss curve not redrawn, no checkpoint."""
    results, before = reruns
    workdir, code, stdout, stderr = results["again"]
    assert code == 0, stderr[-3000:]
    assert stdout.strip() == "run tiny is already at step 8 (target 8): nothing to train" and stderr == ""
    run = workdir / "runs" / "tiny"
    assert {f: (run / f).read_bytes() for f in before} == before
    assert sorted(p.name for p in (workdir / "checkpoints" / "tiny").iterdir()) == ["run_config.json", "step-8"]


def test_a_changed_model_under_a_used_id_is_refused_in_one_line(reruns):
    """docs/training.md's first example did this to the quickstart run: another model and batch under a
    finished run's id. Exit 2, one line naming each changed key and how to start a new run; nothing written."""
    results, before = reruns
    workdir, code, stdout, stderr = results["changed"]
    assert code == 2, stderr[-3000:]
    err = stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("qkvflow train: error: run 'tiny' was started with another config"), err
    assert "model.ode.num_steps 2 -> 4, trainer.train_batch_size 8 -> 16;" in err[0] and "--trainer.id NEW" in err[0]
    run = workdir / "runs" / "tiny"
    assert {f: (run / f).read_bytes() for f in before} == before


def test_a_finished_run_extended_by_num_train_steps_trains_on(reruns, reference):
    """`trainer.num_train_steps` may change on resume (Levanter's trainer allows it): the finished 8-step run
    trains step 9 from its checkpoint; its first 8 losses stay the reference run's, each step once."""
    results, _ = reruns
    workdir, code, stdout, stderr = results["extend"]
    assert code == 0, stderr[-3000:]
    assert "resuming run tiny after step 8" in stdout and "step 9/9" in stdout and "step 8/9" not in stdout
    extended = losses(workdir)
    assert len(extended) == 9 and extended[:8] == losses(reference[0])
    assert (workdir / "checkpoints" / "tiny" / "step-9" / "metadata.json").is_file()


@pytest.mark.parametrize(
    "summary, stop_after, line",
    [
        ({"steps": 8}, None, "done"),
        ({"steps": 8}, 8, "done"),
        ({"steps": 4}, 4, "stopped after step 4 of 8 (stop_after 4); run the same command without --stop_after"),
        ({"steps": 4, "nothing_to_train": True}, 3, "stopped after step 4 of 8 (stop_after 3)"),
        ({"steps": 3, "preempted": True}, 4, "preempted"),
        ({"steps": 6}, None, "done: the training data ran out after step 6 of 8 (epochs: 0)"),
    ],
)
def test_the_summary_says_how_the_run_ended(summary, stop_after, line):
    """The summary says "done" only at num_train_steps (8 here) or when the epochs end the run; a stop_after
    stop says what to run to continue (the same command would find nothing to train)."""
    import dataclasses

    from qkvflow.cli.train import headline
    from qkvflow.runs.config import TrainConfig

    config = TrainConfig()
    trainer = dataclasses.replace(config.trainer, num_train_steps=8)
    config = dataclasses.replace(config, stop_after=stop_after, trainer=trainer)
    assert headline(summary, config).startswith(line)


MESHES = {
    # parameters replicated (no `embed: data` parameter mapping): 4-way data parallelism
    "data_parallel": ["--trainer.mesh.param_mapping", "{}"],
    "fsdp": [],  # Levanter's default mesh: parameters' embed axis over the 4-way data axis
    # 2-way FSDP x 2-way tensor parallelism over the hypernetwork's mlp and heads axes (Levanter's
    # default shared mapping puts mlp and heads on the model axis)
    "fsdp_x_tensor_parallel": ["--trainer.mesh.axes", "{data: 2, replica: 1, model: 2}"],
}


@pytest.mark.parametrize("mode", list(MESHES))
def test_four_devices_match_one(four_device_runs, reference, mode):
    one = reference[0]
    four, code, _, stderr, _ = four_device_runs[mode]
    assert code == 0, stderr[-3000:]
    # Same data, same initial state, same arithmetic; only the order of f32 reductions differs (the
    # gradient and loss sums are split over 4 shards and combined by all-reduce), which moves a
    # result by an ulp or so (f32 eps 1.2e-7). Measured over the 8 steps on marin-levanter (FSDP):
    # at most 2.6e-7 relative. 2e-5 leaves room for that to compound, and is still far below what a
    # real sharding bug gives (a wrong or dropped shard, or a different data order: 1e-3 and more).
    assert losses(four) == pytest.approx(losses(one), rel=2e-5, abs=2e-5)


BAD = [
    (
        ["--corpus", "null", "--data.components", "{web: {source: {type: url, train_urls: [missing.jsonl]}}}"],
        "data.components.web.source.train_urls[0]: file 'missing.jsonl' does not exist",
    ),
    (["--trainer.num_train_stepz", "3"], "unrecognized arguments: --trainer.num_train_stepz"),
    (["--model.num_heads", "3"], "num_heads=3 is invalid: expected a divisor of hidden_dim=32"),
    (["--trainer.train_batch_size", "6"], "trainer.train_batch_size=6 is not divisible by the data-parallel size 4"),
    (["--trainer.load_checkpoint_path", "{ckpt}/garbage"], "is not a readable checkpoint"),
    (
        ["--trainer.mesh.axes", "{data: -1, replica: 1, model: 3}"],
        "trainer.mesh.axes={'data': -1, 'replica': 1, 'model': 3} does not fit the 4 available devices",
    ),
]


BAD_IDS = ["missing-data", "unknown-key", "bad-heads", "batch", "checkpoint", "model-axis"]


@pytest.fixture(scope="module")
def four_device_runs(tmp_path_factory, corpus_root):
    """One 4-device process that trains the tiny run under each of MESHES, stops a run after step 4 and
    resumes it ("stop", "resume": one work folder), runs each BAD case and a run whose folder another
    process holds, every other case in a work folder of its own: (work folder, exit code, stdout, stderr,
    the checkpoint tree before, or for "locked" the holder's pid) per case id. A BAD case's folder already
    holds a finished checkpoint and a foreign folder."""
    import subprocess
    import sys

    from tests.train_utils import train_args, train_env

    cases, before = {}, {}
    for mode, args in MESHES.items():
        workdir = tmp_path_factory.mktemp(f"four-{mode}")
        before[mode] = (workdir, None)
        cases[mode] = train_args(workdir, corpus_root, *args, *NO_EVAL)[3:]  # after `python -m qkvflow`
    stopped = tmp_path_factory.mktemp("four-stop-resume")
    before["stop"] = before["resume"] = (stopped, None)
    cases["stop"] = train_args(stopped, corpus_root, "--stop_after", "4", *NO_EVAL)[3:]
    # runs after "stop" (dicts keep order), with other cadences: keys a resume may change (run_record.MAY_CHANGE)
    cadences = ["--trainer.steps_per_eval", "500", "--trainer.checkpointer.save_interval", "2h"]
    cases["resume"] = train_args(stopped, corpus_root, *NO_EVAL, *cadences)[3:]
    # a run begun with float32 first moments (the default before bfloat16), uninterrupted and stopped; its
    # resume with an explicit bfloat16 is refused, with the default `auto` it continues in float32
    f32, whole, stopped_f32 = (
        ["--hypernetwork_mu_dtype", "float32"],
        tmp_path_factory.mktemp("four-f32"),
        tmp_path_factory.mktemp("four-f32-stop"),
    )
    for case, workdir, args in [
        ("f32", whole, f32),
        ("f32-stop", stopped_f32, [*f32, "--stop_after", "4"]),
        ("f32-as-bf16", stopped_f32, ["--hypernetwork_mu_dtype", "bfloat16"]),
        ("f32-resume", stopped_f32, []),
    ]:
        before[case] = (workdir, None)
        cases[case] = train_args(workdir, corpus_root, *args, *NO_EVAL)[3:]
    for case, (args, _message) in zip(BAD_IDS, BAD):
        workdir = tmp_path_factory.mktemp(f"bad-{case}")
        existing = workdir / "checkpoints" / "tiny" / "step-5"
        existing.mkdir(parents=True)
        (existing / "manifest.ocdbt").write_bytes(
            b"\0" * 32
        )  # a checkpoint as Levanter writes it: store, then metadata
        (existing / "metadata.json").write_text(
            '{"step": 5, "timestamp": "2025-01-01T00:00:05", "is_temporary": false}'
        )
        (workdir / "checkpoints" / "garbage").mkdir()
        (workdir / "checkpoints" / "garbage" / "junk.bin").write_bytes(b"\0" * 10)
        before[case] = (workdir, sorted(p.name for p in (workdir / "checkpoints").rglob("*")))
        args = [a.replace("{ckpt}", str(workdir / "checkpoints")) for a in args]
        cases[case] = train_args(workdir, corpus_root, *args)[3:]
    # a run folder held by another process, with that process's checkpoint write in progress
    locked = tmp_path_factory.mktemp("locked")
    (locked / "checkpoints" / "tiny" / "step-3" / "model").mkdir(parents=True)
    cases["locked"] = train_args(locked, corpus_root)[3:]
    # the issue-31 case: another checkpoint base path, but the holder's tracker folder (its metrics and plot)
    shared = tmp_path_factory.mktemp("locked-tracker")
    (shared / "runs" / "tiny").mkdir(parents=True)
    (shared / "runs" / "tiny" / "metrics.jsonl").write_text('{"event": "log", "step": 0, "metrics": {}}\n')
    cases["locked-tracker"] = train_args(
        shared, corpus_root, "--trainer.checkpointer.base_path", str(shared / "other")
    )[3:]
    hold = (
        "import sys\nfrom qkvflow.runs.runlock import RunLock\n[RunLock(p).acquire() for p in sys.argv[1:]]\n"
        "print('held', flush=True)\nsys.stdin.read()\n"
    )
    holder = subprocess.Popen([sys.executable, "-c", hold, str(locked / "checkpoints" / "tiny"), str(shared / "runs" / "tiny")],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert holder.stdout.readline() == "held\n"
        results = cli_in_one_process(cases, train_env(4), cwd=tmp_path_factory.getbasetemp())
    finally:
        holder.stdin.close()
        holder.wait(timeout=limit(60))
    before["locked"] = (locked, holder.pid)
    before["locked-tracker"] = (shared, holder.pid)
    return {case: (before[case][0], *results[case], before[case][1]) for case in cases}


@pytest.mark.parametrize("args,message", BAD, ids=BAD_IDS)
def test_bad_input_fails_cleanly_without_touching_checkpoints(four_device_runs, request, args, message):
    workdir, code, _, stderr, before = four_device_runs[request.node.callspec.id]
    assert code == 2, stderr[-2000:]
    assert message in stderr
    assert "Traceback" not in stderr
    assert sorted(p.name for p in (workdir / "checkpoints").rglob("*")) == before


def test_load_model_reads_the_trained_weights(reference, corpus_root):
    import jax.numpy as jnp
    import jax.random as jrandom
    from haliax import Axis

    from qkvflow.errors import UserError
    from qkvflow.runs.config import TrainConfig
    from qkvflow.runs.model import load_model
    from tests.helpers import parse_config
    from tests.train_utils import TINY

    workdir, _ = reference
    args = ["--corpus.root", str(corpus_root)]
    config = parse_config(TINY, TrainConfig, args)
    model, tokenizer = load_model(config, str(workdir / "checkpoints" / "tiny"))
    fresh = config.model.build(Axis("vocab", len(tokenizer)), key=jrandom.PRNGKey(0))
    trained, initial = model.generator.weights["w1"].proj.array, fresh.generator.weights["w1"].proj.array
    assert trained.shape == initial.shape and not jnp.allclose(trained, initial)
    wrong = parse_config(TINY, TrainConfig, args + ["--model.hidden_dim", "64"])
    with pytest.raises(UserError, match="does not hold a DiffEqFormerGpt2Config"):
        load_model(wrong, str(workdir / "checkpoints" / "tiny"))


def test_run_lock_refuses_a_second_holder_and_recovers_a_stale_one(tmp_path):
    import json
    import socket

    from qkvflow.errors import UserError
    from qkvflow.runs.runlock import LOCK_FILE, RunLock

    run = tmp_path / "checkpoints" / "tiny"
    with RunLock(str(run)):
        holder = json.loads((run / LOCK_FILE).read_text())
        assert holder["pid"] == os.getpid() and holder["host"] == socket.gethostname()
        with pytest.raises(UserError) as error:
            RunLock(str(run)).acquire()
        message = str(error.value)
        assert f"in use by process {os.getpid()} on host {socket.gethostname()}" in message
        assert str(run / LOCK_FILE) in message and "\n" not in message
    assert not (run / LOCK_FILE).exists()  # released and removed on exit
    with RunLock(str(run)):
        pass
    assert not (tmp_path / "checkpoints").exists()  # the folders it created, left empty: removed too
    # a lock file left by a process that died (flock ends with its process): taken over
    run.mkdir(parents=True)
    (run / LOCK_FILE).write_text(json.dumps({"host": socket.gethostname(), "pid": 2**22 + 7, "started": "x"}))
    with RunLock(str(run)):
        assert json.loads((run / LOCK_FILE).read_text())["pid"] == os.getpid()


def test_run_lock_taken_on_a_file_its_holder_just_removed_is_taken_again(tmp_path, monkeypatch):
    """A holder that ends between our `open` and our `flock` has removed the file we opened: the lock we
    then get is on a file no one else can find. The lock is taken again on the current file, so that a
    third run is refused (without the re-check, it would create a new file and run beside us)."""
    import fcntl
    import json

    from qkvflow.errors import UserError
    from qkvflow.runs.runlock import LOCK_FILE, RunLock

    run = tmp_path / "checkpoints" / "tiny"
    holder = RunLock(str(run)).acquire()
    flock, calls = fcntl.flock, []

    def holder_ends_first(fd, operation):
        if operation & fcntl.LOCK_EX:
            calls.append(fd)
            if len(calls) == 1:
                holder.release()  # unlinks the file just opened by the second run, then unlocks it
        return flock(fd, operation)

    monkeypatch.setattr(fcntl, "flock", holder_ends_first)
    second = RunLock(str(run)).acquire()
    monkeypatch.setattr(fcntl, "flock", flock)
    try:
        with pytest.raises(UserError, match=f"in use by process {os.getpid()} "):
            RunLock(str(run)).acquire()
        assert len(calls) == 2  # the first lock, on the removed file, was let go
        assert json.loads((run / LOCK_FILE).read_text())["pid"] == os.getpid()
    finally:
        second.release()


def test_second_train_of_the_same_run_is_refused_in_one_line(four_device_runs):
    """While another process holds the run (here a tiny holder instead of a whole training run, started
    by four_device_runs), `qkvflow train` with the same id exits 2 in one line, before writing or
    removing anything: the holder's checkpoint write in progress (a step folder without metadata yet)
    survives."""
    workdir, code, _, stderr, holder_pid = four_device_runs["locked"]
    run = workdir / "checkpoints" / "tiny"
    assert code == 2, stderr[-3000:]
    err = stderr.strip().splitlines()
    assert err[-1].startswith(f"qkvflow train: error: run folder {run} is in use by process {holder_pid} on host "), err
    assert "Traceback" not in stderr
    assert (run / "step-3" / "model").is_dir() and not (workdir / "runs" / "tiny" / "metrics.jsonl").exists()


def test_a_run_sharing_another_runs_tracker_folder_is_refused(four_device_runs):
    """Issue 31: the lock covers everything a run writes, not only its checkpoint folder. A run with the held
    run's id and tracker path but another checkpoint base path would rewrite that run's metrics.jsonl and
    loss curve: it exits 2 in one line naming the tracker folder, and the holder's metrics are untouched."""
    workdir, code, _, stderr, holder_pid = four_device_runs["locked-tracker"]
    folder = workdir / "runs" / "tiny"
    assert code == 2, stderr[-3000:]
    err = stderr.strip().splitlines()
    assert err[-1].startswith(f"qkvflow train: error: run folder {folder} is in use by process {holder_pid} "), err
    assert "Traceback" not in stderr
    assert (folder / "metrics.jsonl").read_text() == '{"event": "log", "step": 0, "metrics": {}}\n'
    assert not (workdir / "other").exists()  # its checkpoint folder's lock, taken first, released and removed


def test_the_run_locks_cover_checkpoints_tracker_folders_and_the_log_file(tmp_path):
    """`session.run_locks` of a run: its checkpoint folder, each jsonl tracker's folder, its log file; a
    second holder of any one is refused, and a refused acquisition releases what it had taken."""
    from qkvflow.errors import UserError
    from qkvflow.runs.config import TrainConfig
    from qkvflow.runs.runlock import RunLock
    from qkvflow.training import session
    from tests.helpers import parse_config
    from tests.train_utils import TINY

    args = ["--trainer.checkpointer.base_path", str(tmp_path / "ck"), "--trainer.log_dir", str(tmp_path / "logs"),
            "--trainer.tracker", f"[{{type: jsonl, path: {tmp_path / 'a'}}}, {{type: jsonl, path: {tmp_path / 'b'}}}]"]  # fmt: skip
    t = parse_config(TINY, TrainConfig, args).trainer
    locks = session.run_locks(t, "tiny")
    assert [lock.path for lock in locks.locks] == [
        str(tmp_path / p)
        for p in ("ck/tiny/.qkvflow.lock", "a/tiny/.qkvflow.lock", "b/tiny/.qkvflow.lock", "logs/tiny.log.lock")
    ]
    for lock in locks.locks:
        with RunLock(lock.run_path, lock.lock_file):
            with pytest.raises(UserError, match="is in use by process"):
                session.run_locks(t, "tiny").acquire()
            others = [other.path for other in locks.locks if other.path != lock.path]
            assert not any(os.path.exists(path) for path in others)  # what the refused run took is released
    with locks:
        assert all(os.path.exists(lock.path) for lock in locks.locks)
    assert not any(os.path.exists(lock.path) for lock in locks.locks)
    assert sorted(os.listdir(tmp_path)) == []  # the folders the locks created, empty, are removed with them


@pytest.mark.parametrize("taken", [1, 3])
def test_the_loader_builds_no_more_batches_than_the_run_can_take(taken):
    """`bound_read_ahead(loader, taken)` on the loader `Trainer.data_loader` makes: after the run's `taken`
    batches, Levanter's background thread has read at most `taken` more (its buffer) plus one read of up
    to `taken` in flight, where by default it reads 32 at a time into a buffer of 128; the batches are the
    dataset's first ones, in order. Fails when Levanter stops reading the two attributes it sets."""
    import time

    import haliax as hax
    import jax
    import numpy as np
    from jax.sharding import Mesh
    from levanter.data.dataset import ListAsyncDataset
    from levanter.trainer import Trainer, TrainerConfig

    from qkvflow.training.loop import bound_read_ahead

    batch, read = 2, []

    class Counting(ListAsyncDataset):
        async def get_batch(self, indices):
            read.extend(indices)
            return await super().get_batch(indices)

    data = Counting([np.full((3,), i, dtype=np.int32) for i in range(1000)])
    mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1, 1), ("replica", "data", "model"))
    # the loader as `Trainer.data_loader` makes it for a run, without building a run (it reads only these)
    trainer = Trainer.__new__(Trainer)
    trainer.config = TrainerConfig(train_batch_size=batch)
    with hax.partitioning.set_mesh(mesh):
        trainer.__dict__["device_mesh"] = mesh
        trainer.__dict__["compute_axis_mapping"] = {"batch": ("replica", "data")}
        loader = trainer.data_loader(data)
        assert (loader.prefetch_size, loader.max_buffered_batches) == (32, 128)  # what the bound is below
        bound_read_ahead(loader, taken)
        batches = loader.iter_from_step(0)
        got = [np.asarray(next(batches))[:, 0].tolist() for _ in range(taken)]
    assert got == [[2 * b, 2 * b + 1] for b in range(taken)]
    time.sleep(1.0)  # let the thread read what it will
    # `taken` + a buffer of `taken` + one read of `taken` in flight; once more index 0 (the loader's probe
    # of an example's shape), which set() drops
    assert len(set(read)) <= 3 * taken * batch, sorted(set(read))
