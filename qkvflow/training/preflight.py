"""Checks of a training config before anything is built, so bad input fails fast and clearly.

Each raises `UserError` naming the config key or file and what was expected; none writes anything,
so a failed start never touches an existing checkpoint.

* `check_outputs` runs before anything else: every folder the run writes to (checkpoints, tracker,
  logs) gets a probe file created and removed, so an unwritable location fails now, not at the first save.
* `check` runs next and needs no accelerator: values, the data files (`qkvflow.runs.data_checks`),
  the checkpoint path. Nothing here may
  start JAX's backend, which must stay untouched until `jax.distributed.initialize` (multi-process).
* `check_devices` runs after Levanter's initialisation: sizes that depend on the device count.
* `check_resume` runs before the trainer loads a checkpoint: every array the config's model has must be
  in the checkpoint with the same shape (a different tokenizer vocabulary or model type fails here,
  with its name, instead of deep inside the restore).
"""

import levanter.checkpoint

from qkvflow.errors import UserError
from qkvflow.models import layout
from qkvflow.outputs import check_writable
from qkvflow.runs.checkpoint_arrays import array_shapes, is_ocdbt
from qkvflow.runs.configfile import check_config_file  # noqa: F401  (moved: the CLI checks it before heavy imports)
from qkvflow.runs.data_checks import check_data
from qkvflow.runs.tracking import JsonlTrackerConfig
from qkvflow.training.adam import resolve
from qkvflow.training.faults import NONFINITE_MODES
from qkvflow.training.loss import check_vocab_block


def _positive(key: str, value, *, allow_none=False, minimum=1) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        expected = f"an integer >= {minimum}" + (" or null" if allow_none else "")
        raise UserError(f"{key}={value!r} is invalid: expected {expected}")


def check_run_id(run_id) -> None:
    """`trainer.id` names the run's folders (checkpoints/<id>, runs/<id>): a plain name, not a path
    (no separator, not `.` or `..`, not empty, no spaces or control characters)."""
    if run_id is None:
        return
    if (
        not isinstance(run_id, str)
        or run_id in ("", ".", "..")
        or any(c in run_id for c in "/\\ ")
        or not run_id.isprintable()
    ):
        raise UserError(
            f"trainer.id={run_id!r} is invalid: expected a plain name without '/', '\\', spaces, "
            "and not '.' or '..' (it names the run's folders)"
        )


def check_values(config) -> None:
    t = config.trainer
    check_run_id(t.id)
    if hasattr(config, "hypernetwork_mu_dtype"):
        resolve(config.hypernetwork_mu_dtype)
    _positive("trainer.num_train_steps", t.num_train_steps)
    if getattr(config, "loss_vocab_block", None) is not None:
        _positive("loss_vocab_block", config.loss_vocab_block)
        check_vocab_block(config.model.model_type, config.loss_vocab_block)
    if isinstance(t.train_batch_size, int):
        _positive("trainer.train_batch_size", t.train_batch_size)
    _positive("trainer.steps_per_eval", t.steps_per_eval)
    _positive("trainer.max_eval_batches", t.max_eval_batches, allow_none=True, minimum=0)
    for axis, size in dict(t.mesh.axes).items():
        if size != -1:
            _positive(f"trainer.mesh.axes.{axis}", size)
    for key in ("per_device_parallelism", "per_device_eval_parallelism"):
        value = getattr(t, key)
        if value != -1:
            _positive(f"trainer.{key}", value)
    for i, policy in enumerate(t.checkpointer.keep):
        if not isinstance(policy, dict) or "every" not in policy or set(policy) - {"every", "until"}:
            raise UserError(
                f"trainer.checkpointer.keep[{i}]={policy!r} is invalid: expected {{every: N}} or {{every: N, until: M}}"
            )
        _positive(f"trainer.checkpointer.keep[{i}].every", policy["every"])
        _positive(f"trainer.checkpointer.keep[{i}].until", policy.get("until"), allow_none=True)
    _positive("log_every", config.log_every)
    _positive("epochs", config.epochs, minimum=0)
    _positive("stop_after", config.stop_after, allow_none=True)
    nonfinite = getattr(config, "nonfinite", "stop")
    if nonfinite not in NONFINITE_MODES:
        raise UserError(f"nonfinite={nonfinite!r} is invalid: expected one of {', '.join(NONFINITE_MODES)}")
    if config.z_loss_weight < 0:
        raise UserError(f"z_loss_weight={config.z_loss_weight!r} is invalid: expected a float >= 0")
    optimizer = config.optimizer
    for key in ("learning_rate", "weight_decay"):
        value = getattr(optimizer, key, None)
        if isinstance(value, (int, float)) and value < 0:
            raise UserError(f"optimizer.{key}={value!r} is invalid: expected a float >= 0")


def check_batch(trainer_config) -> None:
    """The mesh fits the devices (`trainer.mesh.axes`), and the batch sizes divide over its
    data-parallel size."""
    import jax

    devices = jax.device_count()
    try:
        trainer_config.mesh.axis_shapes(devices, trainer_config.num_slices)
    except ValueError as e:
        axes = dict(trainer_config.mesh.axes)
        raise UserError(f"trainer.mesh.axes={axes} does not fit the {devices} available devices ({e})") from None
    data_parallel = trainer_config.data_axis_size
    for key in ("train_batch_size", "eval_batch_size"):
        size = getattr(trainer_config, key)
        if isinstance(size, int) and size > 0 and size % data_parallel:
            raise UserError(
                f"trainer.{key}={size} is not divisible by the data-parallel size {data_parallel} "
                f"({devices} devices, trainer.mesh.axes={dict(trainer_config.mesh.axes)}); pick a multiple of {data_parallel}"
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


def check_resume(config, Vocab):
    """If this run resumes (or initialises) from a checkpoint, the checkpoint's model arrays must be
    the ones the config builds. Reads one small metadata file per array. Returns the checkpoint
    (a `step-N` folder) that the trainer will load, or None for a new run."""
    import equinox as eqx
    import jax.random as jrandom
    from haliax import NamedArray
    from levanter.utils.jax_utils import leaf_key_paths

    t = config.trainer
    if t.load_checkpoint is False:
        return
    path = t.load_checkpoint_path or t.checkpointer.expanded_path(t.id)
    if not levanter.checkpoint.is_checkpoint_path(path):
        if not t.initialize_from:
            return None  # a new run
        path = t.initialize_from
    latest = levanter.checkpoint.discover_latest_checkpoint(path)
    if latest is None:
        return None
    if t.load_checkpoint is not False and not is_ocdbt(str(latest)) and array_shapes(str(latest)):
        raise UserError(
            f"checkpoint {latest!r} was written by qkvflow 0.1 (levanter 1.2.dev1644, one zarr folder per array): its "
            "model loads here (export, analyze, finetune) but a run cannot resume from it on marin-levanter, whose "
            "optimizer state differs; finish the run with qkvflow 0.1, or start a new run (a new trainer.id)"
        )
    is_named = lambda x: isinstance(x, NamedArray)  # noqa: E731
    shapes = eqx.filter_eval_shape(lambda: config.model.build(Vocab, key=jrandom.PRNGKey(0)))
    names = leaf_key_paths(shapes, prefix="model", is_leaf=is_named)
    import jax

    leaves = jax.tree_util.tree_leaves(shapes, is_leaf=is_named)
    keys = jax.tree_util.tree_leaves(names, is_leaf=lambda x: isinstance(x, str))
    stored_shapes = array_shapes(str(latest))
    if layout.is_stacked(shapes) and layout.holds_per_weight(stored_shapes):
        raise UserError(
            f"checkpoint {latest!r} was written by qkvflow 0.2.0 with one hypernetwork per weight "
            "(generator.weights.*, before they were stacked): its model loads here (eval, export, analyze, "
            "finetune) but a run cannot resume from it, whose optimizer state is per weight; start a new run "
            "(a new trainer.id) or fine-tune from it"
        )
    model_type = type(config.model).__name__
    how = f"use a new trainer.id to start a new run, or the config the run was started with (resuming {t.id!r})"
    for key, leaf in zip(keys, leaves):
        array = leaf.array if is_named(leaf) else leaf
        if not hasattr(array, "shape"):
            continue
        stored = stored_shapes.get("/".join(key.split(".")))
        if stored is None:
            if t.allow_partial_checkpoint:  # missing arrays are initialised instead
                continue
            raise UserError(
                f"checkpoint {latest!r} has no array {key}: it was written for a different model than this "
                f"config's {model_type} (model.type or its shape keys differ); {how}"
            )
        if tuple(stored) != tuple(array.shape):
            axes = ", ".join(f"{a.name}={a.size}" for a in leaf.axes) if is_named(leaf) else str(tuple(array.shape))
            raise UserError(
                f"checkpoint {latest!r}: {key} has shape {tuple(stored)} but this config's {model_type} "
                f"needs ({axes}){_shape_hint(leaf, stored, Vocab) if is_named(leaf) else ''}; {how}"
            )
    return str(latest)


AXIS_KEYS = {
    "embed": "model.hidden_dim",
    "heads": "model.num_heads",
    "head_size": "model.hidden_dim / model.num_heads",
    "mlp": "model.intermediate_dim",
    "position": "model.max_seq_len",
    "time_freq": "model.num_frequencies",
    "time_feature": "model.num_frequencies",
    "time_embed": "model.time_embed_dim",
    "time_hidden": "model.time_embed_dim",
    "layers": "model.num_layers",
}
"""The config keys that set each named axis of a model array (for shape mismatches)."""


def _shape_hint(leaf, stored, Vocab) -> str:
    """Which axes differ between the checkpoint and the config, and which keys set them. The
    tokenizer is blamed only when the vocab axis itself differs."""
    if len(stored) != len(leaf.axes):
        return ""
    differ = [(a, n) for a, n in zip(leaf.axes, stored) if a.size != n]
    if any(a.name == "vocab" for a, _ in differ):
        return (
            f"; the tokenizer's vocabulary ({Vocab.size} tokens with padding, from data.tokenizer or "
            "corpus.vocab_size) differs from the one the checkpoint was trained with"
        )
    return "; " + ", ".join(
        f"{a.name}={n} in the checkpoint vs {a.size} here"
        + (f" (set by {AXIS_KEYS[a.name]})" if a.name in AXIS_KEYS else "")
        for a, n in differ
    )


def _trackers(trainer_config) -> list:
    trackers = trainer_config.tracker
    return list(trackers) if isinstance(trackers, (list, tuple)) else [trackers]


def check_outputs(config) -> None:
    """Probe (`qkvflow.outputs.check_writable`) every local folder the run will write to:
    `trainer.checkpointer.base_path`, the jsonl tracker's `path`, a tensorboard tracker's `logdir` and
    `trainer.log_dir`. Runs before the corpus, the tokenizer and Levanter's initialisation."""
    from levanter.tracker.tensorboard import TensorboardConfig

    t = config.trainer
    check_run_id(t.id)  # a path-like id would put the run's files elsewhere
    check_writable(t.checkpointer.base_path, "trainer.checkpointer.base_path")
    trackers = _trackers(t)
    for i, tracker in enumerate(trackers):
        where = f"trainer.tracker[{i}]" if isinstance(t.tracker, (list, tuple)) else "trainer.tracker"
        if isinstance(tracker, JsonlTrackerConfig):
            check_writable(tracker.path, f"{where}.path")
        elif isinstance(tracker, TensorboardConfig):
            check_writable(tracker.logdir, f"{where}.logdir")
    check_writable(t.log_dir, "trainer.log_dir")


def check(config) -> None:
    """Everything that needs neither devices nor the model (run before Levanter's initialisation)."""
    check_values(config)
    check_data(config.data)
    check_checkpoint(config.trainer)


def check_devices(trainer_config) -> None:
    """What depends on the device count (run after `jax.distributed.initialize`)."""
    check_batch(trainer_config)
