"""Checks of a training config before anything is built, so bad input fails fast and clearly.

Each raises `UserError` naming the config key or file and what was expected; none writes anything,
so a failed start never touches an existing checkpoint.
"""

import os
import urllib.parse

import jax
import levanter.checkpoint

from qkvflow.errors import UserError


def _local_path(url: str):
    parsed = urllib.parse.urlparse(url)
    if parsed.scheme in ("", "file"):
        return parsed.path if parsed.scheme else url
    return None  # remote (gs://, hf://, https://): checked by Levanter when read


def check_data(data) -> None:
    for key in ("train_urls", "validation_urls"):
        for i, url in enumerate(getattr(data, key, ()) or ()):
            path = _local_path(url)
            if path is None or any(c in path for c in "*{["):
                continue
            if not os.path.exists(path):
                raise UserError(f"data.{key}[{i}]: file {path!r} does not exist (expected a jsonl or txt file)")
            if os.path.getsize(path) == 0:
                raise UserError(f"data.{key}[{i}]: file {path!r} is empty (expected at least one document)")
    tokenizer = getattr(data, "tokenizer", None)
    if tokenizer and (tokenizer.startswith((".", "/")) or os.sep in tokenizer) and not os.path.exists(tokenizer):
        raise UserError(f"data.tokenizer: {tokenizer!r} does not exist (expected a Hugging Face tokenizer folder)")


def check_batch(trainer_config) -> None:
    devices = jax.device_count()
    model = trainer_config.model_axis_size
    if devices % model:
        raise UserError(f"trainer.model_axis_size={model} does not divide the {devices} available devices")
    data_parallel = devices // model
    for key in ("train_batch_size", "eval_batch_size"):
        size = getattr(trainer_config, key)
        if isinstance(size, int) and size > 0 and size % data_parallel:
            raise UserError(
                f"trainer.{key}={size} is not divisible by the data-parallel size {data_parallel} "
                f"({devices} devices / model_axis_size {model}); pick a multiple of {data_parallel}"
            )


def check_checkpoint(trainer_config) -> None:
    path = trainer_config.load_checkpoint_path
    if path is None:
        return
    if not levanter.checkpoint.is_checkpoint_path(path):
        raise UserError(
            f"trainer.load_checkpoint_path={path!r} is not a readable checkpoint "
            "(expected a folder written by Levanter's checkpointer, e.g. checkpoints/<run_id>/step-100)"
        )


def check(config) -> None:
    check_data(config.data)
    check_batch(config.trainer)
    check_checkpoint(config.trainer)
