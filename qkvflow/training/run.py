"""Pretraining a language model with Levanter's trainer (what `qkvflow train` runs; the command is in
qkvflow.cli.train).

Levanter owns the loop, sharding, data, checkpoints and logging; this module picks the loss,
adds evaluation with perplexity, and writes a loss curve. Resuming: the newest complete checkpoint of
the run (`trainer.id`) is loaded and the data loader continues from its step.

Faults (see qkvflow.training.faults): SIGTERM saves a checkpoint after the current step; interrupted
checkpoint writes are removed before resuming; a non-finite loss or gradient stops the run
(`nonfinite: stop`, `faults.NonFiniteError`) or skips the step (`nonfinite: skip`).

Several processes (multi-host, or several processes on one machine) run the same command; Levanter's
`trainer.distributed` section (or SLURM / TPU auto-detection) connects them. Only process 0 writes
metrics, the loss curve and checkpoint metadata; every process writes its shards of the arrays.
"""

import contextlib
import dataclasses
import os

import jax
import jax.random as jrandom
import levanter
import levanter.tracker

from qkvflow.plotting import plot_loss_curve
from qkvflow.runs.config import TrainConfig
from qkvflow.runs.tracking import metrics_file
from qkvflow.training import adam, faults, halting_phase, loop, preflight, session
from qkvflow.training.loss import train_loss


def train(config: TrainConfig) -> dict:
    """Train; return a summary of the final step (losses, perplexities, where outputs went)."""
    with contextlib.ExitStack() as cleanup:
        preemption = cleanup.enter_context(faults.Preemption())  # from here on, SIGTERM and SIGINT mean "stop cleanly"
        return _train(config, preemption, cleanup)


def _train(config: TrainConfig, preemption: faults.Preemption, cleanup: contextlib.ExitStack) -> dict:
    preflight.check_outputs(config)  # before the corpus, the tokenizer and Levanter start
    finished = session.nothing_to_train(config)  # a finished run run again: one line, nothing written
    if finished is not None:
        return finished

    def prepare(config, tokenizer, Vocab):  # before the run writes anything (session.start)
        # a JAX computation, so after jax.distributed is started (session.start calls this after it)
        model_key = jrandom.split(jrandom.PRNGKey(config.trainer.seed), 4)[2]
        # a halting phase (qkvflow.training.halting_phase): the model comes from the aligned checkpoint and
        # only its halting head trains; its own checkpoints hold only the head, so check_resume does not apply
        config, model, is_trainable = halting_phase.prepare(config, Vocab, model_key)
        resume_from = None if model is not None else preflight.check_resume(config, Vocab)
        mu_dtype = adam.for_resume(config.hypernetwork_mu_dtype, resume_from)  # auto: as the run began
        config = dataclasses.replace(config, hypernetwork_mu_dtype=mu_dtype)
        return (config, model, is_trainable, resume_from, model_key), config.model.max_Pos

    _, tokenizer, inject, Vocab, tokens, prepared = session.start(config, cleanup, prepare)
    config, model, is_trainable, resume_from, model_key = prepared
    t = config.trainer
    Pos = config.model.max_Pos
    run = loop.Run(
        config,
        "qkvflow train",
        Pos,
        init=None if model is not None else lambda: config.model.build(Vocab, key=model_key),
        model=model,
        is_trainable=is_trainable,
        flops_per_token=config.model.flops_per_token(len(tokenizer), Pos.size),
    )
    summary, _ = loop.train_run(run, train_loss(config), tokenizer, preemption, tokens, inject, resume_from)

    jsonl = loop.jsonl_tracker(t)
    if jsonl is not None and jax.process_index() == 0 and "run_id" in summary:
        summary["metrics"] = metrics_file(jsonl.path, summary["run_id"])
        if config.loss_curve and os.path.exists(summary["metrics"]):
            out = os.path.join(os.path.dirname(summary["metrics"]), config.loss_curve)
            summary["loss_curve"] = plot_loss_curve(summary["metrics"], out, title=f"{type(config.model).__name__}")
    levanter.tracker.current_tracker().finish()
    return summary
