"""`qkvflow train`: pretrain a language model with Levanter's trainer.

Levanter owns the loop, sharding, data, checkpoints and logging; the run (qkvflow.training.run) picks
the loss, adds evaluation with perplexity, and writes a loss curve; this module parses the command line,
prints the summary and gives the exit status. Resuming: run the same command with the
same `--trainer.id`; the newest complete checkpoint of that run is loaded and the data loader
continues from its step.

Faults (see qkvflow.training.faults): SIGTERM saves a checkpoint after the current step and exits 0;
interrupted checkpoint writes are removed before resuming; a non-finite loss or gradient stops the
run with exit status 3 (`nonfinite: stop`) or skips the step (`nonfinite: skip`).

Several processes (multi-host, or several processes on one machine) run the same command; Levanter's
`trainer.distributed` section (or SLURM / TPU auto-detection) connects them. Only process 0 writes
metrics, the loss curve and checkpoint metadata; every process writes its shards of the arrays.
"""

import signal
import sys

from qkvflow.cli.startup import usage
from qkvflow.runs import configfile
from qkvflow.runs.config import TrainConfig
from qkvflow.training import faults
from qkvflow.training.run import train


def headline(summary: dict, config: TrainConfig) -> str:
    """How the run ended, for the summary's first line: preempted; done (at `trainer.num_train_steps`, or
    when `epochs` passes over the data end it sooner); or stopped by `stop_after` before the end, which
    a run without it (or with a larger one) continues from the step's checkpoint."""
    steps, total, stop_after = summary.get("steps", 0), config.trainer.num_train_steps, config.stop_after
    if summary.get("preempted"):
        return "preempted"
    if steps < total and stop_after is not None and steps >= stop_after:
        return (
            f"stopped after step {steps} of {total} (stop_after {stop_after}); "
            "run the same command without --stop_after (or with a larger one) to continue"
        )
    if steps < total:
        return f"done: the training data ran out after step {steps} of {total} (epochs: {config.epochs})"
    return "done"


def print_summary(summary: dict, config: TrainConfig) -> None:
    if summary.get("nothing_to_train"):
        return  # its one line is said
    print(f"\n== qkvflow train: {headline(summary, config)} ==")
    for key in ("run_id", "steps", "skipped_steps", "train_loss", "train_perplexity", "eval_loss", "eval_perplexity"):
        if key in summary:
            value = summary[key]
            print(f"{key:>17}: {value:.4f}" if isinstance(value, float) else f"{key:>17}: {value}")
    for key in ("checkpoints", "metrics", "loss_curve"):
        if key in summary:
            print(f"{key:>17}: {summary[key]}")


def _run(config: TrainConfig) -> dict:
    summary = train(config)
    print_summary(summary, config)
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
    if usage.wants_help(argv):
        print(usage.short_help("qkvflow train", TrainConfig, "Pretrain a language model with Levanter's trainer."))
        return 0
    try:
        summary = _run(configfile.parse(TrainConfig, usage.full_listing_args(argv), "train"))
    except faults.NonFiniteError as e:
        print(
            f"qkvflow train: error: {e}. Nothing was saved for this step; the newest checkpoint is from before it. "
            "Lower the learning rate, or set `nonfinite: skip` to skip such steps.",
            file=sys.stderr,
        )
        return NONFINITE_EXIT
    return stop_status(summary)
