"""`qkvflow train`: pretrain a language model with Levanter's trainer.

Levanter owns the loop, sharding, data, checkpoints and logging; this module picks the loss,
adds evaluation with perplexity, and writes a loss curve. Resuming: run the same command with the
same `--trainer.id`; the newest checkpoint of that run is loaded and the data loader continues
from its step.
"""

import dataclasses
import functools
import itertools
import logging
import math
import os
import time

import jax.random as jrandom
import levanter
import levanter.config
import levanter.eval
from haliax import Axis
from haliax.partitioning import round_axis_for_partitioning
from levanter import callbacks
from levanter.checkpoint import Checkpointer
from levanter.trainer import Trainer
from levanter.utils.jax_utils import parameter_count

from qkvflow import preflight
from qkvflow.config import TrainConfig
from qkvflow.loss import lm_loss
from qkvflow.plotting import plot_loss_curve
from qkvflow.tracking import JsonlTrackerConfig, metrics_file

logger = logging.getLogger("qkvflow.train")


def with_corpus(config: TrainConfig) -> TrainConfig:
    """Build the configured offline corpus (if any) and point `data` at its files and tokenizer."""
    if config.corpus is None:
        return config
    from qkvflow.data.corpora import prepare_corpus

    corpus = prepare_corpus(config.corpus.name, config.corpus.root, vocab_size=config.corpus.vocab_size)
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


def _eval_hook(trainer, config, eval_sets, tokenizer, summary):
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


def _build_caches(data, timeout: float = 1800.0) -> None:
    """Tokenize into Levanter's caches and wait for them before reading: reading a cache that is
    still being built can stall Levanter's loader indefinitely."""
    for split in ("train", "validation"):
        try:
            caches = data.build_caches(split, monitors=False)
        except (AttributeError, TypeError):  # configs without this hook build lazily
            return
        for cache in caches.values():
            cache.await_finished(timeout=timeout)


def _save_final_checkpoint(trainer, info) -> None:
    """Save the last step and wait for the write.

    Levanter's trainer runs its hooks with force=True after the last step, but its callback wrapper
    drops the flag, so the checkpointer saves only on its own schedule; and writes are asynchronous.
    """
    for hook in trainer.hooks.hooks:
        checkpointer = getattr(getattr(hook.fn, "fn", None), "__self__", None)
        if isinstance(checkpointer, Checkpointer):
            checkpointer.on_step(info, force=True)
            checkpointer.wait_until_finished()


def train(config: TrainConfig) -> dict:
    """Train; return a summary of the final step (losses, perplexities, where outputs went)."""
    config = with_corpus(config)
    preflight.check(config)
    tokenizer = config.data.the_tokenizer
    levanter.initialize(config)
    optimizer = config.optimizer.build(config.trainer.num_train_steps)
    loss_fn = functools.partial(lm_loss, z_loss_weight=config.z_loss_weight)
    summary: dict = {}

    with Trainer(config.trainer, optimizer, loss_fn) as trainer:
        data_key, _, model_key, training_key = jrandom.split(jrandom.PRNGKey(config.trainer.seed), 4)
        if config.data_seed is not None:
            data_key = jrandom.PRNGKey(config.data_seed)
        Pos = config.model.Pos
        vocab_size = len(tokenizer)
        Vocab = round_axis_for_partitioning(Axis("vocab", vocab_size), trainer.parameter_axis_mapping)

        _build_caches(config.data)
        epochs = config.epochs if config.epochs > 0 else None
        train_set = config.data.train_set(Pos, config.trainer.batch_schedule, key=data_key, epochs=epochs)
        eval_sets = config.data.tagged_eval_sets(Pos)
        state = trainer.initial_state(training_key, model_init=lambda: config.model.build(Vocab, key=model_key))
        if int(state.step) > 0:
            logger.info(f"Resuming run {trainer.run_id} from step {int(state.step)}")
        levanter.tracker.log_summary({"parameter_count": parameter_count(state.model)})

        if eval_sets:
            trainer.add_hook(_eval_hook(trainer, config, eval_sets, tokenizer, summary), every=config.trainer.steps_per_eval)
        flops = config.model.flops_per_token(vocab_size)
        flops_per_example = 3 * flops * Pos.size if flops is not None else None
        trainer.add_hook(callbacks.log_performance_stats(Pos.size, trainer.config.batch_schedule, flops_per_example), every=1)
        tokens_per_step = config.trainer.train_batch_size * Pos.size
        stats_hook = _train_stats_hook(summary, config.trainer.num_train_steps, config.log_every, tokens_per_step)
        trainer.add_hook(stats_hook, every=1)

        loader = trainer.data_loader(train_set).iter_from_step(int(state.step))
        if config.stop_after is not None:
            loader = itertools.islice(loader, max(0, config.stop_after - int(state.step)))
        info = trainer.train(state, loader)
        _save_final_checkpoint(trainer, info)
        summary["run_id"] = trainer.run_id
        summary["steps"] = int(info.step) + 1
        if summary["steps"] < min(config.trainer.num_train_steps, config.stop_after or math.inf):
            logger.warning(f"The training data ran out after {summary['steps']} steps; set `epochs` to loop it.")
        summary["checkpoints"] = config.trainer.checkpointer.expanded_path(trainer.run_id)

    jsonl = _jsonl_tracker(config.trainer)
    if jsonl is not None:
        summary["metrics"] = metrics_file(jsonl.path, summary["run_id"])
        if config.loss_curve:
            out = os.path.join(os.path.dirname(summary["metrics"]), config.loss_curve)
            summary["loss_curve"] = plot_loss_curve(summary["metrics"], out, title=f"{type(config.model).__name__}")
    levanter.tracker.current_tracker().finish()
    return summary


def print_summary(summary: dict) -> None:
    print("\n== qkvflow train: done ==")
    for key in ("run_id", "steps", "train_loss", "train_perplexity", "eval_loss", "eval_perplexity"):
        if key in summary:
            value = summary[key]
            print(f"{key:>17}: {value:.4f}" if isinstance(value, float) else f"{key:>17}: {value}")
    for key in ("checkpoints", "metrics", "loss_curve"):
        if key in summary:
            print(f"{key:>17}: {summary[key]}")


def _run(config: TrainConfig) -> None:
    print_summary(train(config))


def main(argv: list[str]) -> int:
    levanter.config.main(_run, args=argv)()
    return 0
