"""`qkvflow train`: pretrain a language model with Levanter's trainer.

Levanter owns the loop, sharding, data, checkpoints and logging; this module picks the loss,
adds evaluation with perplexity, and writes a loss curve. Resuming: run the same command with the
same `--trainer.id`; the newest complete checkpoint of that run is loaded and the data loader
continues from its step.

Faults (see qkvflow.faults): SIGTERM saves a checkpoint after the current step and exits 0;
interrupted checkpoint writes are removed before resuming; a non-finite loss or gradient stops the
run with exit status 3 (`nonfinite: stop`) or skips the step (`nonfinite: skip`).

Several processes (multi-host, or several processes on one machine) run the same command; Levanter's
`trainer.distributed` section (or SLURM / TPU auto-detection) connects them. Only process 0 writes
metrics, the loss curve and checkpoint metadata; every process writes its shards of the arrays.
"""

import contextlib
import dataclasses
import functools
import logging
import os
import signal
import sys
from typing import Optional

import haliax.partitioning
import jax
import jax.random as jrandom
import levanter
import levanter.tracker
from haliax import Axis
from haliax.partitioning import round_axis_for_partitioning

from qkvflow import faults, preflight
from qkvflow.config import TrainConfig
from qkvflow.errors import UserError
from qkvflow.loss import lm_loss
from qkvflow.plotting import plot_loss_curve
from qkvflow.runlock import RunLock
from qkvflow.tracking import metrics_file
from qkvflow.training import loop

logger = logging.getLogger("qkvflow.train")


def check_corpus(c) -> None:
    """UserError unless the `corpus:` section names a known corpus and a usable vocabulary size."""
    from qkvflow.data.corpora import NAMES

    if c.name not in NAMES:
        raise UserError(f"corpus.name={c.name!r} is invalid: expected one of {', '.join(NAMES)}")
    if c.vocab_size is not None and (isinstance(c.vocab_size, bool) or c.vocab_size < 1):
        raise UserError(f"corpus.vocab_size={c.vocab_size!r} is invalid: expected null or an integer >= 1")


def with_corpus(config: TrainConfig) -> TrainConfig:
    """Build the configured offline corpus (if any) and point `data` at its files and tokenizer."""
    if config.corpus is None:
        return config
    from qkvflow.data.corpora import prepare_corpus

    c = config.corpus
    check_corpus(c)
    try:
        corpus = prepare_corpus(c.name, c.root, vocab_size=c.vocab_size)
    except (ValueError, RuntimeError) as e:  # e.g. a vocabulary size the corpus cannot have
        raise UserError(f"corpus: {e}") from None
    data = corpus.data_config(c.name, config.data)
    return dataclasses.replace(config, data=data)


def announce_corpus(config) -> None:
    """Say which corpus is prepared (building it trains a tokenizer); printed before JAX starts, so by
    every process."""
    if config.corpus is not None:
        print(f"preparing corpus {config.corpus.name} in {os.path.join(config.corpus.root, config.corpus.name)} ...", flush=True)


def _initialize(config: TrainConfig) -> Optional[RunLock]:
    """Levanter's initialisation, with the device-dependent checks between `jax.distributed` and
    Levanter's own validation (which would fail with a traceback on the same problems). Takes the
    run lock (returned; process 0 only) before Levanter opens the run's trackers."""
    t = config.trainer
    for key, value in t.jax_config.items():  # e.g. jax_cpu_collectives_implementation before distributed
        jax.config.update(key, value)
    t.distributed.initialize()  # jax.distributed when configured, or detected (SLURM, TPU pods)
    t.distributed = dataclasses.replace(t.distributed, initialize_jax_distributed=False)
    if jax.process_count() > 1:
        print(
            f"process {jax.process_index()} of {jax.process_count()}: {jax.local_device_count()} local devices, "
            f"{jax.device_count()} in all",
            flush=True,
        )
    lock = _lock_run(t) if t.id is not None else None
    try:
        preflight.check_devices(t)
        log_dir = str(t.log_dir)
        before = set(os.listdir(log_dir)) if os.path.isdir(log_dir) else set()
        levanter.initialize(config)
        _fix_log_file_name(log_dir, before)
        quiet_console(getattr(config, "verbose", False))
        return lock or _lock_run(t)  # or the id Levanter chose (RUN_ID, wandb's, a random one)
    except BaseException:
        if lock is not None:
            lock.release()
        raise


class _ConsoleFilter(logging.Filter):
    """What the terminal shows of the logs: qkvflow's warnings and everyone's errors. Levanter's INFO
    lines (cache loading, tracing, checkpoint commits) and its benign warnings still go to the log file."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.ERROR or (record.levelno >= logging.WARNING and record.name.startswith("qkvflow"))


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


def train(config: TrainConfig) -> dict:
    """Train; return a summary of the final step (losses, perplexities, where outputs went)."""
    with contextlib.ExitStack() as cleanup:
        preemption = cleanup.enter_context(faults.Preemption())  # from here on, SIGTERM and SIGINT mean "stop cleanly"
        return _train(config, preemption, cleanup)


def _lock_run(trainer_config) -> Optional[RunLock]:
    """The run's lock (qkvflow.runlock), taken by process 0 of a run (after `jax.distributed`)."""
    if jax.process_index() != 0:
        return None
    return RunLock(trainer_config.checkpointer.expanded_path(trainer_config.id)).acquire()


def initialize(config: TrainConfig, cleanup: contextlib.ExitStack) -> None:
    """`_initialize`, holding the run lock until `cleanup` closes."""
    lock = _initialize(config)
    if lock is not None:
        cleanup.callback(lock.release)


def _train(config: TrainConfig, preemption: faults.Preemption, cleanup: contextlib.ExitStack) -> dict:
    preflight.check_outputs(config)  # before the corpus, the tokenizer and Levanter start
    announce_corpus(config)
    config = with_corpus(config)
    preflight.check(config)
    tokenizer = preflight.load_tokenizer(config.data)
    try:
        inject = faults.Injection.from_env()
    except ValueError as e:
        raise UserError(str(e)) from None
    initialize(config, cleanup)
    t = config.trainer
    with haliax.partitioning.set_mesh(t.device_mesh):
        Vocab = round_axis_for_partitioning(Axis("vocab", len(tokenizer)), t.parameter_axis_mapping)
    if t.load_checkpoint_path is None:  # this run's own folder: drop writes a kill interrupted
        checkpointer = t.checkpointer
        faults.remove_incomplete_checkpoints(checkpointer.expanded_path(t.id), checkpointer.delete_old_temp_checkpoints)
    resume_from = preflight.check_resume(config, Vocab)
    model_key = jrandom.split(jrandom.PRNGKey(t.seed), 4)[2]
    Pos = config.model.max_Pos
    run = loop.Run(
        config,
        "qkvflow train",
        Pos,
        init=lambda: config.model.build(Vocab, key=model_key),
        flops_per_token=config.model.flops_per_token(len(tokenizer), Pos.size),
    )
    loss_fn = functools.partial(lm_loss, z_loss_weight=config.z_loss_weight)
    summary, _ = loop.train_run(run, loss_fn, tokenizer, preemption, inject, resume_from)

    jsonl = loop.jsonl_tracker(t)
    if jsonl is not None and jax.process_index() == 0 and "run_id" in summary:
        summary["metrics"] = metrics_file(jsonl.path, summary["run_id"])
        if config.loss_curve and os.path.exists(summary["metrics"]):
            out = os.path.join(os.path.dirname(summary["metrics"]), config.loss_curve)
            summary["loss_curve"] = plot_loss_curve(summary["metrics"], out, title=f"{type(config.model).__name__}")
    levanter.tracker.current_tracker().finish()
    return summary


def print_summary(summary: dict) -> None:
    print("\n== qkvflow train: " + ("preempted ==" if summary.get("preempted") else "done =="))
    for key in ("run_id", "steps", "skipped_steps", "train_loss", "train_perplexity", "eval_loss", "eval_perplexity"):
        if key in summary:
            value = summary[key]
            print(f"{key:>17}: {value:.4f}" if isinstance(value, float) else f"{key:>17}: {value}")
    for key in ("checkpoints", "metrics", "loss_curve"):
        if key in summary:
            print(f"{key:>17}: {summary[key]}")


def _run(config: TrainConfig) -> dict:
    summary = train(config)
    print_summary(summary)
    return summary


NONFINITE_EXIT = 3
"""Exit status of a run stopped by a non-finite loss or gradient (bad input is 2)."""


def stop_status(summary) -> int:
    """The exit status of a run that ended without an error: 130 (128 + SIGINT, what a shell reports
    for Ctrl-C) when Ctrl-C stopped it, so that `qkvflow train && next` does not go on; 0 otherwise,
    a SIGTERM preemption included (the checkpoint is saved; the scheduler restarts the run)."""
    stopped_by = summary.get("stopped_by") if isinstance(summary, dict) else None
    return 128 + signal.SIGINT if stopped_by == "SIGINT" else 0


def main(argv: list[str]) -> int:
    from qkvflow import cli, usage

    if usage.wants_help(argv):
        print(usage.short_help("qkvflow train", TrainConfig, "Pretrain a language model with Levanter's trainer."))
        return 0
    try:
        summary = _run(cli.parse(TrainConfig, usage.full_listing_args(argv), "train"))
    except faults.NonFiniteError as e:
        print(
            f"qkvflow train: error: {e}. Nothing was saved for this step; the newest checkpoint is from before it. "
            "Lower the learning rate, or set `nonfinite: skip` to skip such steps.",
            file=sys.stderr,
        )
        return NONFINITE_EXIT
    return stop_status(summary)
