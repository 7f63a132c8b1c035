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
import itertools
import logging
import math
import os
import signal
import sys
import time
from typing import Optional

import haliax.partitioning
import jax
import jax.random as jrandom
import levanter
import levanter.config
import levanter.eval
from haliax import Axis
from haliax.partitioning import round_axis_for_partitioning
from levanter import callbacks
from levanter.checkpoint import Checkpointer
from levanter.utils.jax_utils import parameter_count

from qkvflow import faults, preflight
from qkvflow.checkpoints import restore_error
from qkvflow.config import TrainConfig
from qkvflow.errors import UserError
from qkvflow.loss import lm_loss
from qkvflow.plotting import plot_loss_curve
from qkvflow.runlock import RunLock
from qkvflow.tracking import JsonlTrackerConfig, drop_steps_from, metrics_file

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
    data = dataclasses.replace(
        config.data,
        train_urls=list(corpus.train_urls),
        validation_urls=list(corpus.validation_urls),
        tokenizer=corpus.tokenizer,
        # Levanter reuses a cache by folder name alone; keep it inside the corpus folder, which is
        # replaced whenever the corpus is rebuilt.
        cache_dir=os.path.join(os.path.dirname(corpus.tokenizer), "levanter_cache"),
    )
    return dataclasses.replace(config, data=data)


def _jsonl_tracker(trainer_config):
    trackers = trainer_config.tracker
    trackers = trackers if isinstance(trackers, (list, tuple)) else (trackers,)
    return next((t for t in trackers if isinstance(t, JsonlTrackerConfig)), None)


def _drop_replayed_metrics(trainer_config, run_id: str, start: int) -> None:
    """A run starting at step `start` (0 when a kill came before the first checkpoint) trains again
    the steps a kill lost after its last checkpoint: drop their records from metrics.jsonl first
    (process 0, which alone writes it), so that each step appears once."""
    jsonl = _jsonl_tracker(trainer_config)
    if jsonl is not None and jax.process_index() == 0:
        dropped = drop_steps_from(metrics_file(jsonl.path, run_id), start)
        if dropped:
            logger.info(f"Dropped {dropped} metric records of the steps after step {start}: they are trained again")


def _eval_hook(trainer, config, eval_sets, tokenizer, summary, preemption):
    max_examples = config.trainer.max_eval_batches
    if max_examples is not None:
        max_examples *= config.trainer.eval_batch_size
    evaluator = levanter.eval.TaggedEvaluator(
        config.trainer.EvalBatch,
        eval_sets,
        tokenizer,
        trainer.device_mesh,
        trainer.compute_axis_mapping,
        max_examples,
        mp=config.trainer.mp,
    )

    def evaluate(info):
        if preemption.requested:
            return  # stopping for a preemption: save first, evaluate after the resume
        log = levanter.eval.eval_model(evaluator, info.model, prefix="eval")
        log["eval/perplexity"] = math.exp(log["eval/loss"])
        levanter.tracker.log(log, step=info.step)
        summary.update(eval_loss=log["eval/loss"], eval_perplexity=log["eval/perplexity"])
        print(f"eval at step {int(info.step) + 1}: loss {log['eval/loss']:.4f}  ppl {log['eval/perplexity']:.2f}", flush=True)

    return evaluate


def _train_stats_hook(summary, total_steps: int, log_every: int, tokens_per_step: int):
    last = {"time": time.perf_counter(), "step": None}

    def record(info):
        loss = float(info.loss)
        perplexity = math.exp(min(loss, 80.0))
        levanter.tracker.log({"train/perplexity": perplexity}, step=info.step)
        summary.update(train_loss=loss, train_perplexity=perplexity)
        step = int(info.step) + 1
        if step % log_every == 0 or step == total_steps:
            now = time.perf_counter()
            rate = ""
            if last["step"] is not None:
                rate = f"  {tokens_per_step * (step - last['step']) / (now - last['time']):,.0f} tokens/s"
            if step == last["step"]:
                return  # Levanter reruns hooks once more after the last step
            print(f"step {step}/{total_steps}  loss {loss:.4f}  ppl {perplexity:.2f}{rate}", flush=True)
            last.update(time=now, step=step)

    return record


def say(message: str) -> None:
    """One progress line on stdout from process 0 (after `_initialize`), for the quiet parts of a run:
    building the token cache and compiling take a minute or more before the first step line."""
    if jax.process_index() == 0:
        print(message, flush=True)


def announce_corpus(config) -> None:
    """Say which corpus is prepared (building it trains a tokenizer); printed before JAX starts, so by
    every process."""
    if config.corpus is not None:
        print(f"preparing corpus {config.corpus.name} in {os.path.join(config.corpus.root, config.corpus.name)} ...", flush=True)


def _build_caches(data, timeout: float = 1800.0) -> dict:
    """Tokenize into Levanter's caches and wait for them before reading: reading a cache that is
    still being built can stall Levanter's loader indefinitely. With several processes, process 0
    builds first and the others then load what it wrote (or build their own on a non-shared disk).

    Returns the number of tokens of each split that has data ({} for configs that build lazily)."""
    where = getattr(data, "cache_dir", None)
    say(f"preparing the token cache in {where or 'each dataset cache_dir'} (the first run tokenizes the data) ...")
    start = time.perf_counter()
    tokens: dict = {}

    def build():
        for split in ("train", "validation"):
            try:
                caches = data.build_caches(split, monitors=False)
            except (AttributeError, TypeError):  # configs without this hook build lazily
                return
            for cache in caches.values():
                cache.await_finished(timeout=timeout)
            if caches:
                tokens[split] = sum(_token_count(cache) for cache in caches.values())

    if jax.process_index() == 0:
        build()
    faults.barrier("qkvflow_build_caches")
    if jax.process_index() != 0:
        build()
    say(f"token cache ready ({time.perf_counter() - start:.0f} s)")
    return tokens


def _token_count(cache) -> int:
    """Tokens in a finished Levanter cache: the length of its `input_ids` column, which Levanter's
    token-sequence dataset cuts into sequences of `seq_len`."""
    return int(cache.store.tree["input_ids"].data_size)


def _checkpointers(trainer):
    for hook in trainer.hooks.hooks:
        checkpointer = getattr(getattr(hook.fn, "fn", None), "__self__", None)
        if isinstance(checkpointer, Checkpointer):
            yield checkpointer


def _save_final_checkpoint(trainer, info) -> None:
    """Save the last step and wait for the write.

    Levanter's trainer runs its hooks with force=True after the last step, but its callback wrapper
    drops the flag, so the checkpointer saves only on its own schedule; and writes are asynchronous.
    """
    for checkpointer in _checkpointers(trainer):
        checkpointer.on_step(info, force=True)
        checkpointer.wait_until_finished()


def _wait_for_checkpoints(trainer) -> None:
    """Let checkpoint writes already started finish (they hold finite states) before leaving."""
    for checkpointer in _checkpointers(trainer):
        checkpointer.wait_until_finished()


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
        return lock or _lock_run(t)  # or the id Levanter chose (RUN_ID, wandb's, a random one)
    except BaseException:
        if lock is not None:
            lock.release()
        raise


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
    optimizer = config.optimizer.build(t.num_train_steps)
    loss_fn = functools.partial(lm_loss, z_loss_weight=config.z_loss_weight)
    summary: dict = {}
    target = min(t.num_train_steps, config.stop_after or math.inf)

    with faults.GuardedTrainer(t, optimizer, loss_fn, nonfinite=config.nonfinite, inject=inject) as trainer:
        data_key, _, model_key, training_key = jrandom.split(jrandom.PRNGKey(t.seed), 4)
        if config.data_seed is not None:
            data_key = jrandom.PRNGKey(config.data_seed)
        Pos = config.model.Pos

        try:  # before tokenizing, so that a checkpoint that cannot be restored fails fast
            state = trainer.initial_state(training_key, model_init=lambda: config.model.build(Vocab, key=model_key))
        except (ValueError, FileNotFoundError) as e:  # missing or damaged arrays: one line, not Levanter's list
            error = restore_error(resume_from, e) if resume_from else None
            if error is None:
                raise
            raise error from None
        preflight.check_data_size(_build_caches(config.data), Pos.size)
        epochs = config.epochs if config.epochs > 0 else None
        train_set = config.data.train_set(Pos, t.batch_schedule, key=data_key, epochs=epochs)
        eval_sets = config.data.tagged_eval_sets(Pos)
        say("compiling the training step (the first step takes longest) ...")
        start = int(state.step)
        if start > 0:
            logger.info(f"Resuming run {trainer.run_id} from step {start}")
            print(f"resuming run {trainer.run_id} after step {start}", flush=True)
        _drop_replayed_metrics(t, trainer.run_id, start)
        levanter.tracker.log_summary({"parameter_count": parameter_count(state.model)})
        summary.update(run_id=trainer.run_id, checkpoints=t.checkpointer.expanded_path(trainer.run_id))
        if start >= target:
            print(f"run {trainer.run_id} is already at step {start} (target {target}): nothing to train", flush=True)
            summary["steps"] = start
            levanter.tracker.current_tracker().finish()
            return summary

        if eval_sets and (t.max_eval_batches is None or t.max_eval_batches > 0):  # as Levanter's add_eval_hook
            trainer.add_hook(
                _eval_hook(trainer, config, eval_sets, tokenizer, summary, preemption), every=t.steps_per_eval
            )
        flops = config.model.flops_per_token(len(tokenizer))
        flops_per_example = 3 * flops * Pos.size if flops is not None else None
        trainer.add_hook(callbacks.log_performance_stats(Pos.size, trainer.config.batch_schedule, flops_per_example), every=1)
        tokens_per_step = config.trainer.train_batch_size * Pos.size
        stats_hook = _train_stats_hook(summary, config.trainer.num_train_steps, config.log_every, tokens_per_step)
        trainer.add_hook(stats_hook, every=1)

        loader = trainer.data_loader(train_set).iter_from_step(start)
        if config.stop_after is not None:
            loader = itertools.islice(loader, max(0, config.stop_after - start))
        loader = preemption.wrap(loader, start)
        try:
            info = trainer.train(state, loader)
        except faults.NonFiniteError:
            _wait_for_checkpoints(trainer)
            raise
        except RuntimeError as e:
            if not preemption.requested or "No training steps" not in str(e):
                raise
            print(f"qkvflow train: stopped by {preemption.signal_name} before the first step; nothing to save", file=sys.stderr)
            summary.update(steps=start, preempted=True, stopped_by=preemption.signal_name)
            levanter.tracker.current_tracker().finish()
            return summary
        _save_final_checkpoint(trainer, info)
        summary["steps"] = int(info.step) + 1
        if trainer.skipped_steps:
            summary["skipped_steps"] = list(trainer.skipped_steps)
        if preemption.requested:
            summary.update(preempted=True, stopped_by=preemption.signal_name)
            print(
                f"qkvflow train: stopped by {preemption.signal_name} after step {summary['steps']}/{t.num_train_steps}; "
                f"checkpoint saved in {summary['checkpoints']}; run the same command to resume",
                file=sys.stderr,
                flush=True,
            )
        elif summary["steps"] < target:
            logger.warning(f"The training data ran out after {summary['steps']} steps; set `epochs` to loop it.")

    jsonl = _jsonl_tracker(config.trainer)
    if jsonl is not None and jax.process_index() == 0:
        summary["metrics"] = metrics_file(jsonl.path, summary["run_id"])
        if config.loss_curve:
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
    from qkvflow import usage

    if usage.wants_help(argv):
        print(usage.short_help("qkvflow train", TrainConfig, "Pretrain a language model with Levanter's trainer."))
        return 0
    try:
        summary = levanter.config.main(_run, args=usage.full_listing_args(argv))()
    except faults.NonFiniteError as e:
        print(
            f"qkvflow train: error: {e}. Nothing was saved for this step; the newest checkpoint is from before it. "
            "Lower the learning rate, or set `nonfinite: skip` to skip such steps.",
            file=sys.stderr,
        )
        return NONFINITE_EXIT
    return stop_status(summary)
