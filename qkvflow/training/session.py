"""Setting up a training run: Levanter's initialisation, the run lock and the terminal.

Shared by the verbs that train (`qkvflow train`, `qkvflow finetune`); the corpus a run resolves to is
`qkvflow.runs.corpus`. `initialize` connects processes (`jax.distributed`), runs the
device checks, takes the run lock (qkvflow.runs.runlock) and lets Levanter open its trackers and log
file; `quiet_console` keeps Levanter's INFO lines out of the terminal (they still go to the log file).
"""

import contextlib
import dataclasses
import logging
import logging.handlers
import os
import sys
import time
import warnings
from typing import Callable, NamedTuple, Optional

import jax
import levanter
from haliax import Axis

from qkvflow.data import cache_lock
from qkvflow.errors import UserError
from qkvflow.runs import data_checks, run_record
from qkvflow.runs.config import TrainConfig
from qkvflow.runs.corpus import announce_corpus, with_corpus
from qkvflow.runs.runlock import RunLock, RunLocks
from qkvflow.runs.tracking import JsonlTrackerConfig
from qkvflow.training import distributed, faults, preflight


def _initialize(config: TrainConfig, before_writes: Callable[[], None] = lambda: None) -> Optional[RunLocks]:
    """Levanter's initialisation, with the device-dependent checks between `jax.distributed` and
    Levanter's own validation (which would fail with a traceback on the same problems). Then
    `before_writes` (the checks that need devices but write nothing of the run), then the run lock
    (returned; process 0 only), then Levanter opens the run's trackers."""
    t = config.trainer
    for key, value in t.jax_config.items():  # e.g. jax_cpu_collectives_implementation before distributed
        jax.config.update(key, value)
    distributed.initialize(t.distributed)  # jax.distributed when configured or detected; not for one process
    t.distributed = dataclasses.replace(t.distributed, initialize_jax_distributed=False)
    if jax.process_count() > 1:
        print(
            f"process {jax.process_index()} of {jax.process_count()}: {jax.local_device_count()} local devices, "
            f"{jax.device_count()} in all",
            flush=True,
        )
    preflight.check_devices(t)
    held = _hold_logs(getattr(config, "verbose", False))
    try:
        before_writes()  # a refusal here leaves no run folder, lock file or metrics.jsonl behind
    finally:
        logging.getLogger().removeHandler(held)
    lock = _lock_run(t) if t.id is not None else None
    try:
        log_dir = str(t.log_dir)
        before = set(os.listdir(log_dir)) if os.path.isdir(log_dir) else set()
        with warnings.catch_warnings():  # a process that trains several runs (sweep) sets it once per run
            warnings.filterwarnings("ignore", message="Global tracker is already set")
            levanter.initialize(config)
        _fix_log_file_name(log_dir, before)
        quiet_console(getattr(config, "verbose", False))
        _replay_logs(held)
        return lock or _lock_run(t)  # or the id Levanter chose (RUN_ID, wandb's, a random one)
    except BaseException:
        if lock is not None:
            lock.release()
        raise


def _hold_logs(verbose: bool) -> logging.handlers.BufferingHandler:
    """Hold the log records of the checks before the run's first write (the token cache build among them)
    in memory until Levanter opens the run's log file, and keep them off the terminal as `quiet_console`
    does after. zephyr's workers set up rigging's stderr logging on their first task (clearing the root
    logger's handlers); setting it up here first makes their call a no-op, so its stderr handler is
    filtered before the build logs anything."""
    from rigging.log_setup import configure_logging

    configure_logging(level=logging.INFO)
    quiet_console(verbose)
    held = logging.handlers.BufferingHandler(capacity=sys.maxsize)
    logging.getLogger().addHandler(held)
    return held


def _replay_logs(held: logging.handlers.BufferingHandler) -> None:
    """Write the records `_hold_logs` kept into the run's log file(s), in order."""
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.FileHandler):
            for record in held.buffer:
                if record.levelno >= handler.level:
                    handler.handle(record)
    held.close()


class _ConsoleFilter(logging.Filter):
    """What the terminal shows of the logs: qkvflow's warnings and everyone's errors. Levanter's INFO
    lines (cache loading, tracing, checkpoint commits) and its benign warnings still go to the log file."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.ERROR or (
            record.levelno >= logging.WARNING and record.name.startswith("qkvflow")
        )


def quiet_console(verbose: bool) -> None:
    """Filter the root logger's terminal handlers (those Levanter installs) unless `verbose`; file
    handlers are left alone, so `<log_dir>/<run_id>.log` keeps everything."""
    if verbose:
        return
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.StreamHandler) and not isinstance(handler, logging.FileHandler):
            if not any(isinstance(f, _ConsoleFilter) for f in handler.filters):
                handler.addFilter(_ConsoleFilter())


def _fix_log_file_name(log_dir: str, before: set) -> None:
    """Log to `<log_dir>/<run_id>.log`, not Levanter 1.2's `<run_id>.log.log`.

    Levanter's TrainerConfig.initialize passes "<id>.log" to init_logging, which appends ".log" again.
    The root logger's handler on such a file is replaced by one on the intended name; what was already
    written moves there, and the stray file is removed only if it did not exist before this run (a
    no-op once Levanter names the file itself).
    """
    root = logging.getLogger()
    for handler in list(root.handlers):
        stray = getattr(handler, "baseFilename", "")
        if not (isinstance(handler, logging.FileHandler) and stray.endswith(".log.log")):
            continue
        if os.path.dirname(stray) != os.path.abspath(log_dir):
            continue
        fixed = logging.FileHandler(stray[: -len(".log")], mode="a")
        fixed.setFormatter(handler.formatter)
        fixed.setLevel(handler.level)
        root.removeHandler(handler)
        handler.close()
        if os.path.basename(stray) not in before:
            with contextlib.suppress(FileNotFoundError):  # another process of this run moved it first
                with open(stray) as src:
                    text = src.read()
                with open(fixed.baseFilename, "a") as dst:
                    dst.write(text)
                os.remove(stray)
        root.addHandler(fixed)


def run_locks(trainer_config, run_id: str) -> RunLocks:
    """The locks of everything run `run_id` writes (qkvflow.runs.runlock): its checkpoint folder, the
    folder of each jsonl tracker (metrics.jsonl, the loss curve) and its log file in `trainer.log_dir`."""
    t = trainer_config
    locks = [RunLock(t.checkpointer.expanded_path(run_id))]
    trackers = t.tracker if isinstance(t.tracker, (list, tuple)) else [t.tracker]
    locks += [RunLock(os.path.join(k.path, run_id)) for k in trackers if isinstance(k, JsonlTrackerConfig)]
    log = os.path.join(str(t.log_dir), f"{run_id}.log")
    locks.append(RunLock(str(t.log_dir), lock_file=f"{run_id}.log.lock", what=f"log file {log}"))
    return RunLocks(locks)


def _lock_run(trainer_config) -> Optional[RunLocks]:
    """The run's locks (`run_locks`), taken by process 0 of a run (after `jax.distributed`)."""
    if jax.process_index() != 0:
        return None
    return run_locks(trainer_config, trainer_config.id).acquire()


def initialize(config: TrainConfig, cleanup: contextlib.ExitStack, before_writes=lambda: None) -> None:
    """`_initialize`, holding the run lock until `cleanup` closes."""
    lock = _initialize(config, before_writes)
    if lock is not None:
        cleanup.callback(lock.release)


class Started(NamedTuple):
    config: TrainConfig
    """The config with `data` pointed at the prepared corpus (if it names one)."""
    tokenizer: object
    injection: object
    """`faults.Injection` from the environment (test-only fault injection; None when unset)."""
    Vocab: Axis
    """The vocabulary axis, rounded up for the parameter mapping."""
    tokens: dict
    """Tokens of each split with data (`build_caches`)."""
    prepared: object
    """What the verb's `prepare` returned."""


def _say(message: str) -> None:
    """A progress line on stdout from process 0 (as `qkvflow.training.loop.say`)."""
    if jax.process_index() == 0:
        print(message, flush=True)


def build_caches(data) -> dict:
    """Tokenize into Levanter's caches before reading them. Every process calls Levanter's
    `build_or_load_cache` at the same time: with several processes, its own coordination has process 0
    build while the others take part in its status broadcasts, then load what it wrote (the cache folder
    must be shared, as Levanter requires). The barrier first lines the processes up, so that all of them
    find the cache missing or all find it complete: a process that stood aside while process 0 built (as
    qkvflow did on Levanter 1.2) would leave process 0 waiting on that broadcast forever.

    Returns the number of tokens of each split that has data."""
    _say(f"preparing the token cache in {data.cache_dir} (the first run tokenizes the data) ...")
    start = time.perf_counter()
    tokens: dict = {}
    faults.barrier("qkvflow_build_caches")
    for split in ("train", "validation"):
        caches = cache_lock.build(data, split)  # another run building the same cache finishes first
        if caches:
            tokens[split] = sum(cache.flat_field_length("input_ids") for cache in caches.values())
    _say(f"token cache ready ({time.perf_counter() - start:.0f} s)")
    return tokens


def nothing_to_train(config: TrainConfig) -> Optional[dict]:
    """For a run whose newest checkpoint is at this invocation's target already (run_record.finished):
    the run's config checked against its record (run_record.check), one line saying so, and the summary;
    None for a run with steps to train. Runs before the corpus, the tokenizer and JAX start, and writes
    nothing: a finished run run again leaves its metrics.jsonl and loss curve as they were."""
    step = run_record.finished(config)
    if step is None:
        return None
    preflight.check_values(config)  # a bad value is refused, finished run or not
    run_record.check(config, with_corpus)
    t = config.trainer
    target = min(t.num_train_steps, config.stop_after or t.num_train_steps)
    print(f"run {t.id} is already at step {step} (target {target}): nothing to train", flush=True)
    return {"run_id": t.id, "steps": step, "nothing_to_train": True}


def start(config: TrainConfig, cleanup: contextlib.ExitStack, prepare: Optional[Callable] = None) -> Started:
    """What every training verb does after its own checks and before building a model: compare the config
    with the one the run was started with (qkvflow.runs.run_record), prepare the corpus, run the config
    checks, load the tokenizer, read the fault-injection spec, initialise (processes, Levanter, the run lock
    held until `cleanup` closes), hold the run's config to record at its first start (written by
    `loop.train_run`), and, for a run in its own folder, drop the checkpoint writes a kill interrupted.

    Between connecting the processes and the first write of the run (its lock file, Levanter's trackers),
    `prepare(config, tokenizer, Vocab)` runs the verb's own checks that need devices (a checkpoint that does not fit,
    a pretrained model of the wrong shape) and returns (anything, the model's position axis); then the
    token caches are built and every split must hold one sequence of that axis. So a refused run leaves
    no trace: no empty checkpoints/<id>, no metrics.jsonl, no hparams appended to an existing run's."""
    from haliax.partitioning import round_axis_for_partitioning, set_mesh

    record = run_record.check(config, with_corpus)  # a resumed id with another model, data, optimizer: refused
    parsed = config
    announce_corpus(config)
    config = with_corpus(config)
    preflight.check(config)
    tokenizer = data_checks.load_tokenizer(config.data)
    try:
        injection = faults.Injection.from_env()
    except ValueError as e:
        raise UserError(str(e)) from None
    t = config.trainer
    found: dict = {}

    def before_writes():
        if t.load_checkpoint_path is None and t.id is not None:  # an unreadable checkpoint: refused here
            faults.incomplete_checkpoints(
                t.checkpointer.expanded_path(t.id), t.checkpointer.delete_old_temp_checkpoints
            )
        with set_mesh(t.device_mesh):
            found["Vocab"] = round_axis_for_partitioning(Axis("vocab", len(tokenizer)), t.parameter_axis_mapping)
        found["prepared"], Pos = prepare(config, tokenizer, found["Vocab"]) if prepare else (None, config.model.max_Pos)
        found["tokens"] = build_caches(config.data)
        data_checks.check_data_size(found["tokens"], Pos.size)

    named = t.id is not None
    initialize(config, cleanup, before_writes)
    if not named and t.id is not None:  # an id Levanter chose: a new run, recorded under it
        record = run_record.Pending(run_record.run_folder(t), run_record.snapshot(parsed))
    run_record.hold(run_record.run_folder(t), record)  # written by the run loop once the state is restored
    if t.load_checkpoint_path is None:  # this run's own folder: drop writes a kill interrupted
        checkpointer = t.checkpointer
        faults.remove_incomplete_checkpoints(checkpointer.expanded_path(t.id), checkpointer.delete_old_temp_checkpoints)
    return Started(config, tokenizer, injection, found["Vocab"], found["tokens"], found["prepared"])
