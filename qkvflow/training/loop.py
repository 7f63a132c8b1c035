"""The run loop that `qkvflow train` and `qkvflow finetune` share, on Levanter's public Trainer API.

    trainer = Trainer(config, guard_nonfinite(optimizer), loss, add_default_hooks=False)
    state   = trainer.initial_state(...)                 # a new run, or the newest checkpoint
    hooks   = [non-finite guard, step info, checkpointer, evaluation, throughput, progress]
    for info in trainer.training_steps(state, batches):  # batches stop at a preemption
        guard.check(info)
    trainer.run_hooks(info, force=True); checkpointer.wait_until_finished()

A SIGINT or SIGTERM before the first step (loading, compiling) ends the process at once, with one
line: there is nothing to save (`faults.Preemption.exit_at_once_until_first_step`).

Levanter's own `Trainer.train` is this loop without the guard and without waiting for the last
checkpoint; its default hooks are added here in an order that puts the non-finite guard first
(`qkvflow.training.faults.NonFiniteGuard`: nothing is saved for a bad step) and keeps the checkpointer
(`CheckpointerConfig.create`) in our hands, so the final save can be forced and awaited.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
import sys
import threading
import time
from typing import Callable, Optional

import jax
import jax.random as jrandom
import levanter
import levanter.eval
import levanter.tracker
from levanter import callbacks
from levanter.callbacks import StepInfo
from levanter.trainer import Trainer
from levanter.utils.jax_utils import parameter_count

from qkvflow.errors import UserError
from qkvflow.evaluation.perplexity import eval_losses
from qkvflow.runs import run_record
from qkvflow.runs.checkpoints import restore_error
from qkvflow.runs.tracking import JsonlTrackerConfig, drop_steps_from, metrics_file
from qkvflow.training import adam, faults

logger = logging.getLogger("qkvflow.training")


def say(message: str) -> None:
    """One progress line on stdout from process 0 (after initialisation), for the quiet parts of a
    run: building the token cache and compiling take a minute or more before the first step line."""
    if jax.process_index() == 0:
        print(message, flush=True)


SLOW_COMPILE_S = 90.0
"""Seconds after which a run still compiling its first step says that XLA's banner may follow."""


def slow_compile_note(delay: float = SLOW_COMPILE_S) -> threading.Timer:
    """A started timer that prints one line if it is not cancelled within `delay` seconds (cancel it at the
    first step). XLA logs a banner on stderr when one compile passes 2 minutes, "[Compiling module ...]
    Very slow compile? If you want to file a bug, run with envvar XLA_FLAGS=--xla_dump_to=... "
    (xla/service/slow_operation_alarm.cc, at ERROR level, so it cannot be silenced alone). It means only
    that the compile is slow on this machine (a loaded CPU, a large model): the line says so beforehand."""
    timer = threading.Timer(
        delay,
        say,
        [
            f"still compiling after {delay:.0f} s (a loaded machine or a large model). XLA may print a "
            "'Very slow compile?' banner on stderr: it means only that, not an error; the run goes on"
        ],
    )
    timer.daemon = True
    timer.start()
    return timer


def jsonl_tracker(trainer_config) -> Optional[JsonlTrackerConfig]:
    trackers = trainer_config.tracker
    trackers = trackers if isinstance(trackers, (list, tuple)) else (trackers,)
    return next((t for t in trackers if isinstance(t, JsonlTrackerConfig)), None)


def drop_replayed_metrics(trainer_config, run_id: str, start: int) -> None:
    """A run starting at step `start` (0 when a kill came before the first checkpoint) trains again
    the steps a kill lost after its last checkpoint: drop their records from metrics.jsonl first
    (process 0, which alone writes it), so that each step appears once."""
    jsonl = jsonl_tracker(trainer_config)
    if jsonl is not None and jax.process_index() == 0:
        dropped = drop_steps_from(metrics_file(jsonl.path, run_id), start)
        if dropped:
            logger.info(f"Dropped {dropped} metric records of the steps after step {start}: they are trained again")


def make_evaluator(trainer: Trainer, config, eval_sets, tokenizer):
    """Levanter's TaggedEvaluator over the validation sets. Build it outside the trainer's mesh context:
    inside it, Levanter's tagged dataset places its tag arrays on every device, and the first
    evaluation on several devices fails with "incompatible devices"."""
    t = config.trainer
    max_examples = None if t.max_eval_batches is None else t.max_eval_batches * t.eval_batch_size
    return levanter.eval.TaggedEvaluator(
        t.EvalBatch,
        eval_sets,
        eval_losses(t.mp),
        tokenizer,
        trainer.device_mesh,
        trainer.compute_axis_mapping,
        max_examples,
    )


def evaluate(evaluator, model, step: int, summary: dict, prefix: str = "eval") -> float:
    """One evaluation: log `eval/loss` and `eval/perplexity` at `step` (0-based, the step just done;
    -1 before training), note them in `summary` and print a line naming the step they follow."""
    log = levanter.eval.eval_model(evaluator, model, prefix=prefix)
    loss = log[f"{prefix}/loss"]
    log[f"{prefix}/perplexity"] = math.exp(min(loss, 80.0))
    if step >= 0:
        levanter.tracker.log(log, step=step)
    summary.update(eval_loss=loss, eval_perplexity=log[f"{prefix}/perplexity"])
    when = "before training" if step < 0 else f"after step {step + 1}"
    say(f"eval {when}: loss {loss:.4f}  ppl {log[f'{prefix}/perplexity']:.2f}")
    return loss


def completed(info: StepInfo) -> int:
    """The number of optimizer updates done when `info` is reported: the trainer state's `step`
    (Levanter's `StepInfo.next_step`), one more than `StepInfo.step`, the 0-based index of the update
    just made. qkvflow numbers checkpoints, progress and eval lines by it; metrics keep Levanter's index."""
    return int(info.next_step)


def progress_hook(summary: dict, total_steps: int, log_every: int, tokens_per_step: int):
    """Log train/perplexity every step; print `step k/total loss ppl tokens/s ETA` every `log_every`
    (on every process, as Levanter 1.2's qkvflow did)."""
    last = {"time": time.perf_counter(), "step": None, "first": None}

    def record(info: StepInfo):
        loss = float(info.loss)
        perplexity = math.exp(min(loss, 80.0))
        levanter.tracker.log({"train/perplexity": perplexity}, step=info.step)
        summary.update(train_loss=loss, train_perplexity=perplexity)
        step = completed(info)
        if step == last["step"]:
            return  # the forced hook run after the last step
        if step % log_every == 0 or step == total_steps:
            now = time.perf_counter()
            rate = eta = ""
            if last["step"] is not None:
                per_step = (now - last["time"]) / (step - last["step"])
                rate = f"  {tokens_per_step / per_step:,.0f} tokens/s"
                eta = f"  ETA {_duration(per_step * (total_steps - step))}"
            # from every process (unlike `say`): each host's log shows how far it got, e.g. which step
            # all processes stopped after when a preemption notice reached one of them
            print(f"step {step}/{total_steps}  loss {loss:.4f}  ppl {perplexity:.2f}{rate}{eta}", flush=True)
            last.update(time=now, step=step)

    return record


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    return (
        f"{seconds // 3600}h{seconds % 3600 // 60:02d}m" if seconds >= 3600 else f"{seconds // 60}m{seconds % 60:02d}s"
    )


@dataclasses.dataclass
class Run:
    """What differs between the verbs that train: the model to start from and how to report.

    `init` builds the model (called only for a new run: a resumed run loads it), or `model` is the
    model itself (a fine-tuned base); `is_trainable` is Levanter's filter (LoRA freezes the base);
    `Pos` and `flops_per_token` describe the model."""

    config: object  # a TrainConfig (or a subclass)
    verb: str
    Pos: object
    init: Optional[Callable[[], object]] = None
    model: object = None
    flops_per_token: Optional[float] = None
    is_trainable: object = True
    eval_before: bool = False


def make_trainer(config, loss_fn, inject=None, trainer_config=None) -> tuple[Trainer, object]:
    """Levanter's trainer for `config` (and the optimizer config with its weight-decay mask): the
    optimizer with the hypernetworks' first-moment dtype (`hypernetwork_mu_dtype`) and wrapped in the
    non-finite guard, crash_on_nan/inf off (the guard decides, after the step). `qkvflow plan`
    compiles this trainer's step; `trainer_config` replaces `config.trainer`."""
    t = dataclasses.replace(trainer_config or config.trainer, crash_on_nan=False, crash_on_inf=False)
    optimizer_config = adam.with_decay_mask(config.optimizer, config.model)
    optimizer = adam.with_hypernetwork_mu_dtype(optimizer_config.build(t.num_train_steps), config.hypernetwork_mu_dtype)
    optimizer = faults.guard_nonfinite(optimizer, inject)
    return Trainer(t, optimizer, loss_fn, add_default_hooks=False), optimizer_config


def train_run(
    run: Run, loss_fn, tokenizer, preemption: faults.Preemption, tokens: dict, inject=None, resume_from=None
) -> tuple[dict, object]:
    """Train `run` to `trainer.num_train_steps` (or `stop_after`, or a preemption) on the token caches
    `session.start` built (`session.build_caches`; `tokens`: tokens of each split). Returns the summary and the final trainer
    state (None if no state exists, e.g. stopped before the first step)."""
    config = run.config
    trainer, optimizer_config = make_trainer(config, loss_fn, inject)  # builds objects only: no compile
    preemption.exit_at_once_until_first_step()  # loading and compiling: nothing to save if stopped
    t, optimizer = trainer.config, trainer.optimizer
    guard = faults.NonFiniteGuard(optimizer, config.nonfinite, t.num_train_steps, verb=run.verb)
    summary: dict = {}
    target = min(t.num_train_steps, config.stop_after or math.inf)
    data_key, _, _, training_key = jrandom.split(jrandom.PRNGKey(t.seed), 4)
    if config.data_seed is not None:
        data_key = jrandom.PRNGKey(config.data_seed)

    with trainer:
        try:  # missing or damaged arrays of a checkpoint that check_resume passed
            state = trainer.initial_state(training_key, run.model, run.init, is_trainable=run.is_trainable)
        except (ValueError, FileNotFoundError) as e:  # missing or damaged arrays: one line, not Levanter's list
            error = restore_error(resume_from, e) if resume_from else None
            if error is None:
                raise
            raise error from None
    train_set = config.data.train_set(run.Pos, t.batch_schedule, key=data_key)
    eval_sets = config.data.tagged_eval_sets(run.Pos) if t.max_eval_batches != 0 else []
    evaluator = make_evaluator(trainer, config, eval_sets, tokenizer) if eval_sets else None

    start = int(state.step)
    run_id = trainer.run_id
    if start > 0:
        print(f"resuming run {run_id} after step {start}", flush=True)  # every process: where each one starts
    total, trainable = parameter_count(state.model), parameter_count(state.trainable_model)
    decayed = adam.decayed_parameter_count(optimizer_config, state.trainable_model)
    summary.update(run_id=run_id, checkpoints=t.checkpointer.expanded_path(run_id), parameter_count=total)
    summary["decayed_parameter_count"] = decayed
    if trainable != total:
        summary["trainable_parameter_count"] = trainable
    if start >= target:  # logs nothing: its steps, evaluations and summary are in the run's metrics already
        print(f"run {run_id} is already at step {start} (target {target}): nothing to train", flush=True)
        summary.update(steps=start, nothing_to_train=True)
        return summary, state
    if jax.process_index() == 0:  # the state restored (or built): the config a first start records
        run_record.write_held(t.checkpointer.expanded_path(run_id))
    drop_replayed_metrics(t, run_id, start)
    logger.info(
        f"weight decay on {decayed:,} of {trainable:,} trainable parameters (mask: {optimizer_config.weight_decay_modules!r})"
    )
    levanter.tracker.log_summary(
        {"parameter_count": total, "trainable_parameter_count": trainable, "decayed_parameter_count": decayed}
    )

    with trainer:
        if start == 0 and evaluator is not None and run.eval_before:
            loss = evaluate(evaluator, state.model, -1, {}, prefix="eval")
            summary.update(initial_eval_loss=loss, initial_eval_perplexity=math.exp(min(loss, 80.0)))
            levanter.tracker.log_summary({"eval/initial_loss": loss})
        checkpointer = t.checkpointer.create(run_id)
        last_eval = {"step": None}

        def save(info: StepInfo, force: bool = False):
            # numbered by completed steps (the state's own count), as the progress, eval and resume lines
            # are: step-N holds the state after N updates. Levanter's `info.step` is the 0-based index of
            # the update just made (N - 1); folders named by it (qkvflow 0.2) still load: only the name differs.
            checkpointer.on_step(tree=info.state.saveable_state, step=completed(info), force=force)

        def eval_hook(info: StepInfo):
            if preemption.requested:
                return  # stopping for a preemption: save first, evaluate after the resume
            if last_eval["step"] != info.step:
                evaluate(evaluator, info.state.eval_model, info.step, summary)
                last_eval["step"] = info.step

        # Levanter runs hooks from the third step on (and every step when forced, at the end): what
        # must see every step (the guard, the per-step metrics, progress) is also called below.
        trainer.add_hook(guard.on_step, every=1)  # first: before the checkpointer sees a bad step
        trainer.add_hook(save, every=1)  # the checkpointer keeps its own schedule
        if t.watch.is_enabled:
            trainer.add_hook(t.watch.build(), every=t.watch.interval)
        flops_per_example = 3 * run.flops_per_token * run.Pos.size if run.flops_per_token else None
        trainer.add_hook(callbacks.log_performance_stats(run.Pos.size, t.batch_schedule, flops_per_example), every=1)
        tokens_per_step = t.train_batch_size * run.Pos.size
        step_info = callbacks.log_step_info(t.num_train_steps)
        progress = progress_hook(summary, t.num_train_steps, config.log_every, tokens_per_step)

        # Levanter's data restarts when it runs out: stop after `epochs` passes (one for `epochs: 0`)
        last = min(target, _steps_for_epochs(config, tokens, run.Pos.size))
        loader = trainer.data_loader(train_set)
        bound_read_ahead(loader, last - start)
        batches = itertools.islice(loader.iter_from_step(start), max(0, last - start))
        batches = faults.poison_loss(preemption.wrap(batches, start), start, inject)
        say("compiling the training step (the first step takes longest) ...")
        info, note = None, slow_compile_note()
        try:
            for info in trainer.training_steps(state, batches):
                note.cancel()
                preemption.first_step_done()  # from here on a signal stops after the step, with a checkpoint
                guard.check(info)
                step_info(info)
                progress(info)
                if evaluator is not None and completed(info) % t.steps_per_eval == 0:
                    eval_hook(info)
        except faults.NonFiniteError:
            checkpointer.wait_until_finished()  # writes already started hold finite states
            raise
        finally:
            note.cancel()
        if info is None:
            if preemption.requested:
                print(
                    f"{run.verb}: stopped by {preemption.signal_name} before the first step; nothing to save",
                    file=sys.stderr,
                )
                summary.update(steps=start, preempted=True, stopped_by=preemption.signal_name)
                return summary, state
            raise UserError(
                f"{run.verb}: the training data yielded no batch (expected at least {t.train_batch_size} sequences)"
            )
        trainer.run_hooks(info, force=True)
        checkpointer.wait_until_finished()
        summary["steps"] = completed(info)
        if guard.skipped_steps:
            summary["skipped_steps"] = list(guard.skipped_steps)
        if preemption.requested:
            summary.update(preempted=True, stopped_by=preemption.signal_name)
            print(
                f"{run.verb}: stopped by {preemption.signal_name} after step {summary['steps']}/{t.num_train_steps}; "
                f"checkpoint saved in {summary['checkpoints']}; run the same command to resume",
                file=sys.stderr,
                flush=True,
            )
        else:
            if evaluator is not None:  # the final model's validation loss, unless the hooks just took it
                eval_hook(info)
            if summary["steps"] < target:
                logger.warning(f"The training data ran out after {summary['steps']} steps; set `epochs` to loop it.")
        return summary, info.state


def bound_read_ahead(loader, batches: int) -> None:
    """Let Levanter's `loader` build at most `batches` batches ahead of the step, the most a run that
    takes `batches` more can use. `Trainer.data_loader` asks for 32 at a time and buffers up to 128,
    so a short run or fine-tune spent a background thread on ~10x the batches it trained on (each
    example mapped one by one), CPU the training step shares. Which batch comes at which step does
    not change. tests/test_train.py counts the batches the loader reads."""
    n = max(1, batches)
    loader.prefetch_size = min(loader.prefetch_size, n)
    buffered = loader.max_buffered_batches
    if buffered is None or buffered > n:  # None: unbounded; < 0: no background thread, left as it is
        loader.max_buffered_batches = n


def _steps_for_epochs(config, tokens: dict, seq_len: int) -> int:
    """Steps in `config.epochs` passes (at least one) over the training split: Levanter cuts its token
    stream into sequences of `seq_len` and drops the remainder; a last partial batch is not trained."""
    sequences = tokens.get("train", 0) // seq_len
    return max(config.epochs, 1) * sequences // config.trainer.train_batch_size
