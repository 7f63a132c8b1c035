"""A run's identity: the config a `trainer.id` was started with, and what a resume may change.

The same command again resumes a run exactly (docs/checkpoints.md). The same id with another model,
data, optimizer or batch would instead go on training a different function from the run's checkpoint,
and append its losses to the run's metrics.jsonl and loss curve as if they were one run's. So:

* at its first start a run records its config in `<checkpoints>/<id>/run_config.json` (draccus's
  encoding of the config as parsed, before a `corpus:` is built; written to a temporary file and
  renamed into place, by process 0, once the run holds its lock and has restored or built its state,
  before the first step): `hold`, `write_held`;
* every later start under that id compares its own config with the record, before the corpus, the
  tokenizer or JAX start (`check`): a key outside MAY_CHANGE that differs is refused in one line naming
  each key (old -> new) and how to start a new run instead. Keys that only one side has (a field added
  to the config classes since) are not compared.

Only a run with something to resume is compared: a run folder without a complete checkpoint (a first
start stopped before its first save) starts again from step 0, and its record is replaced.

A run begun before qkvflow kept this record has none. Levanter's tracker wrote the config of each of its
starts to metrics.jsonl (`levanter.tracker.log_configuration`: an `hparams` record, the config as
`dataclasses.asdict` gives it); the first one, what the run began with, stands in for the record. A run
with neither is taken as it is (there is nothing to compare with) and recorded from now on, with a line
saying so.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import json
import os
import re
import sys
from typing import Any, Callable, Optional

from qkvflow import outputs
from qkvflow.errors import UserError
from qkvflow.runs.tracking import JsonlTrackerConfig, metrics_file

RECORD_FILE = "run_config.json"
"""The record's name, in the run's checkpoint folder (beside its `step-N` folders)."""

MAY_CHANGE: tuple[str, ...] = (
    # how long: Levanter's trainer resumes with another num_train_steps (the learning-rate schedule is
    # then that of the new length from the resumed step on); stop_after and epochs bound an invocation
    "trainer.num_train_steps",
    "stop_after",
    "epochs",
    # evaluation and logging cadence, trackers and the terminal
    "trainer.steps_per_eval",
    "eval_before",
    "log_every",
    "verbose",
    "loss_curve",
    "trainer.tracker",
    "trainer.wandb",
    "trainer.log_dir",
    "trainer.watch",
    "trainer.profiler",
    "trainer.log_jaxprs",
    "trainer.log_xla_hlo",
    # checkpoints: their cadence and where a resume loads from
    "trainer.checkpointer",
    "trainer.load_checkpoint",
    "trainer.load_checkpoint_path",
    "trainer.initialize_from",
    "trainer.allow_partial_checkpoint",
    # devices and processes: the same arithmetic but for the order of f32 reductions ("Meshes agree",
    # docs/checkpoints.md), so a run may resume on another device count or mesh
    "trainer.mesh",
    "trainer.use_explicit_mesh_axes",
    "trainer.per_device_parallelism",
    "trainer.per_device_eval_parallelism",
    "trainer.distributed",
    "trainer.jax_config",
    "trainer.jax_compilation_cache_dir",
    "trainer.require_accelerator",
    "trainer.shutdown_at_exit",
    # rematerialisation: the same gradients, recomputed in the backward pass instead of stored (the
    # choices `qkvflow plan --search` ranks)
    "model.ode.checkpoints",
    "model.gradient_checkpointing",
    # the same cross-entropy, summed over other vocabulary blocks
    "loss_vocab_block",
    "model.cross_entropy_block_size",
    # what to do about a non-finite step
    "nonfinite",
    "trainer.crash_on_nan",
    "trainer.crash_on_inf",
    # checked against the checkpoint's own dtype (qkvflow.training.adam.for_resume)
    "hypernetwork_mu_dtype",
    # where files are kept, not what they hold
    "corpus.root",
    "data.cache_dir",
    "data.components.*.cache_dir",
    "data.cache_options",
    "data.auto_build_caches",
    # a fine-tune's exports and a sweep's grid (each cell's own depth, method and rate are its keys)
    "export",
    "sweep",
)
"""The config keys (and every key under them; `*` matches one component name) that may differ between
the starts of one run. Every other key is part of the run: model, data, tokenizer, optimizer, batch size,
seeds, precision, evaluation set. docs/checkpoints.md lists them; tests/test_run_record.py pins the list."""


def may_change(key: str) -> bool:
    """Whether the dotted `key` is (under) one of MAY_CHANGE."""
    return any(key == p or key.startswith(p + ".") or fnmatch.fnmatchcase(key, p) for p in MAY_CHANGE)


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    """{dotted key: value} of a nested mapping (lists are values)."""
    if isinstance(tree, dict) and (tree or not prefix):
        flat: dict[str, Any] = {}
        for key, value in tree.items():
            flat.update(flatten(value, f"{prefix}.{key}" if prefix else str(key)))
        return flat
    return {prefix: tree}


def _plain(tree: Any) -> Any:
    """JSON's view of `tree` (what the record holds when read back): tuples become lists, other
    objects their string."""
    return json.loads(json.dumps(tree, default=str))


def snapshot(config) -> dict[str, Any]:
    """The config as the record holds it: draccus's encoding (a model's or optimizer's `type` included),
    flattened to dotted keys."""
    import draccus

    return flatten(_plain(draccus.encode(config)))


def _hparams_view(config) -> dict[str, Any]:
    """The config as Levanter's tracker logs it (`hparams_to_dict`, then the jsonl tracker's JSON),
    flattened: to compare with the `hparams` record of a run begun before RECORD_FILE existed."""
    from levanter.tracker.json_logger import _to_jsonable

    return flatten(_plain(_to_jsonable(dataclasses.asdict(config))))


def changed(recorded: dict[str, Any], current: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """(key, recorded value, current value) of each key outside MAY_CHANGE whose value differs. A key that
    only one side has is a field added or removed since, and not compared, unless the other side holds a
    section there (keys under it): a section replaced by a single value, such as `corpus: null` for a
    corpus, or `data.components: {}` for components, is a change of that key."""
    found = [
        (key, recorded[key], current[key]) for key in recorded.keys() & current.keys() if recorded[key] != current[key]
    ]
    for key in recorded.keys() - current.keys():
        if _has_section(current, key):
            found.append((key, recorded[key], _section(current, key)))
    for key in current.keys() - recorded.keys():
        if _has_section(recorded, key):
            found.append((key, _section(recorded, key), current[key]))
    return sorted((c for c in found if not may_change(c[0])), key=lambda c: c[0])


def _has_section(flat: dict[str, Any], key: str) -> bool:
    return any(k.startswith(key + ".") for k in flat)


def _section(flat: dict[str, Any], key: str) -> dict:
    """The nested mapping of the keys under `key`."""
    return _unflatten({k[len(key) + 1 :]: v for k, v in flat.items() if k.startswith(key + ".")})


SHOWN = 4
"""How many changed keys a refusal names before "and N more"."""


def _value(value: Any) -> str:
    return "null" if value is None else json.dumps(value) if not isinstance(value, str) else value


def refusal(run_id: str, where: str, changes: list[tuple[str, Any, Any]]) -> str:
    """The one-line refusal: the run, each changed key (old -> new, at most SHOWN), where the record is,
    and what to do."""
    listed = ", ".join(f"{key} {_value(old)} -> {_value(new)}" for key, old, new in changes[:SHOWN])
    more = f" and {len(changes) - SHOWN} more" if len(changes) > SHOWN else ""
    return (
        f"run {run_id!r} was started with another config ({where}): {listed}{more}; a resume may change only "
        f"its length, cadences, checkpoints and devices (docs/checkpoints.md): start a new run with "
        f"--trainer.id NEW, or resume with the run's own settings"
    )


def run_folder(trainer_config) -> Optional[str]:
    """The run's own checkpoint folder, or None without an id (Levanter picks a new one)."""
    if trainer_config.id is None:
        return None
    return str(trainer_config.checkpointer.expanded_path(trainer_config.id))


def newest_step(folder: str) -> Optional[int]:
    """The step of the newest complete checkpoint in the run folder `folder`, the one a resume loads: the
    largest `step` of a `step-N` folder's `metadata.json` (Levanter writes it last). None if there is none.
    Read directly rather than with Levanter's `discover_latest_checkpoint`, which logs (to the terminal,
    before logging is set up) when it finds none; an unreadable metadata.json is the run's own start-up's
    to name (qkvflow.training.faults)."""
    import fsspec

    fs, root = fsspec.core.url_to_fs(folder)
    if not fs.isdir(root):
        return None
    steps = []
    for entry in fs.ls(root, detail=False):
        if not re.fullmatch(r"step-\d+", os.path.basename(entry.rstrip("/"))):
            continue
        try:
            with fs.open(os.path.join(entry, "metadata.json")) as f:
                steps.append(int(json.load(f)["step"]))
        except (OSError, ValueError, KeyError, TypeError):
            continue  # an interrupted write (no metadata.json yet), or one the start-up refuses
    return max(steps, default=None)


def _read_json(path: str) -> Optional[dict]:
    import fsspec

    try:
        with fsspec.open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise UserError(f"{path} cannot be read ({e}): it records the config this run was started with") from None


def _first_hparams(trainer_config) -> Optional[tuple[str, dict]]:
    """(metrics file, the config of the run's first start) from the jsonl tracker's metrics.jsonl, if any."""
    trackers = trainer_config.tracker if isinstance(trainer_config.tracker, (list, tuple)) else [trainer_config.tracker]
    for tracker in trackers:
        if not isinstance(tracker, JsonlTrackerConfig):
            continue
        file = metrics_file(tracker.path, trainer_config.id)
        if not os.path.isfile(file):
            continue
        with open(file, "rb") as f:
            for line in f:
                try:
                    record = json.loads(line)
                except ValueError:
                    continue
                if isinstance(record, dict) and record.get("event") == "hparams":
                    return file, record.get("hparams") or {}
    return None


@dataclasses.dataclass(frozen=True)
class Pending:
    """A record to write once the run has restored its state (`hold`, `write_held`)."""

    folder: str
    config: dict
    note: Optional[str] = None
    """A line to print when the record is written."""


def check(config, with_corpus: Callable = lambda config: config) -> Optional[Pending]:
    """Refuse (UserError, one line) a start whose config differs from the one its run was started with
    in a key outside MAY_CHANGE. Reads the run's record (or, for older runs, its first `hparams`) and the
    newest checkpoint's metadata only. Returns the record to write at this start (`hold`), or None.

    `with_corpus` points `data` at a `corpus:` (`qkvflow.runs.corpus.with_corpus`, which the caller passes): Levanter
    logged an older run's config after it, so that run's `hparams` are compared with the config after it."""
    t = config.trainer
    folder = run_folder(t)
    if folder is None:
        return None
    current = snapshot(config)
    pending = Pending(folder, current)
    if t.load_checkpoint is False or newest_step(folder) is None:  # nothing of this run is loaded
        return pending
    path = os.path.join(folder, RECORD_FILE)
    record = _read_json(path)
    if record is not None:
        if not isinstance(record, dict) or not isinstance(record.get("config"), dict):
            raise UserError(f"{path} is not a record of a run's config (expected a JSON object with a config mapping)")
        changes = changed(flatten(record["config"]), current)
        if changes:
            raise UserError(refusal(t.id, f"recorded in {path}", changes))
        return None
    older = _first_hparams(t)
    if older is None:
        note = (
            f"run {t.id!r} had no record of the config it was started with (begun before qkvflow kept one): "
            f"this start's config is recorded in {path}"
        )
        return dataclasses.replace(pending, note=note)
    file, hparams = older
    changes = changed(flatten(_plain(hparams)), _hparams_view(with_corpus(config)))
    if changes:
        raise UserError(refusal(t.id, f"its first start's hyperparameters in {file}", changes))
    return pending


_held: dict[str, Optional[Pending]] = {}
"""The record each run folder's start will write (`hold`, `write_held`)."""


def hold(folder: Optional[str], pending: Optional[Pending]) -> None:
    """Keep the record `check` returned for the run folder `folder` until the run has restored its state
    (`write_held`): a start refused at the restore (a checkpoint with missing or damaged arrays) writes
    nothing into the checkpoint folder. Called by `session.start`; kept here rather than passed along
    because the verbs' run loop (`loop.train_run`) sees the config after the corpus and the verb changed it."""
    if folder is not None:
        _held[folder] = pending


def write_held(folder: str) -> None:
    """Write the record held for `folder`, if any (process 0, holding the run lock, before the first step)."""
    write(_held.pop(str(folder), None))


def write(pending: Optional[Pending]) -> None:
    """Write the record (process 0, holding the run lock): to a temporary file beside it, renamed into
    place, so that a kill leaves the old record or the new one; on a remote file system, in one write."""
    if pending is None:
        return
    import fsspec

    if pending.note:
        print(pending.note, file=sys.stderr, flush=True)

    path = os.path.join(pending.folder, RECORD_FILE)
    text = json.dumps({"config": _unflatten(pending.config)}, indent=1, sort_keys=True) + "\n"
    if "://" in pending.folder and not pending.folder.startswith("file://"):
        with fsspec.open(path, "w") as f:
            f.write(text)
        return
    outputs.replace_whole(path.removeprefix("file://"), text.encode())


def _unflatten(flat: dict[str, Any]) -> dict:
    tree: dict = {}
    for key, value in flat.items():
        node = tree
        *parents, last = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = value
    return tree


def finished(config) -> Optional[int]:
    """The step of the run's newest checkpoint when it is at or past this invocation's target
    (`trainer.num_train_steps`, or `stop_after` when smaller): nothing to train. None otherwise, and for
    a run that loads another folder's checkpoint or none."""
    t = config.trainer
    folder = run_folder(t)
    if folder is None or t.load_checkpoint is False or t.load_checkpoint_path is not None:
        return None
    step = newest_step(folder)
    target = min(t.num_train_steps, config.stop_after or t.num_train_steps)
    return step if step is not None and step >= target else None
