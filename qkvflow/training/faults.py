"""Preemption, interrupted checkpoint writes and non-finite steps: what `qkvflow train` does about them.

* **Preemption and Ctrl-C** (`Preemption`): qkvflow.training.preemption.
* **Interrupted checkpoint writes** (`remove_incomplete_checkpoints`): Levanter writes a checkpoint's
  arrays first and its `metadata.json` last (after every process has committed its shards), and only
  folders with a `metadata.json` count as checkpoints. A process killed during a write leaves a
  `step-N` folder without one; such folders, and only those, are removed before training starts, so
  resuming always loads the newest complete checkpoint and a later save into the same folder starts
  from scratch. A `step-N` folder whose `metadata.json` exists but cannot be read (or lacks the integer
  `step` and ISO-format `timestamp` Levanter needs, without which it would pass over the folder and
  resume from an older one) is not provably an interrupted write (its arrays may be complete): the run
  stops with one line naming the folder and how to resume from an earlier step, and nothing is removed.
* **Non-finite steps** (`guard_nonfinite`, `NonFiniteGuard`): every step computes one fused "is everything finite"
  reduction over the loss and the gradients, inside the compiled step. A non-finite step never changes
  the model or the optimizer state. With `nonfinite: stop` (the default) the run ends with
  `NonFiniteError` before any hook (checkpointer included) sees the step, naming the step and where the
  non-finite values first appeared: in a parameter, in the loss (the forward pass), or in the
  gradient of a named parameter. With `nonfinite: skip` the step is counted, reported and skipped.

Testing only (not a user feature): the environment variable ``QKVFLOW_TEST_INJECT_NONFINITE``
poisons one step inside the compiled train step, so that the tests can exercise the guard:
``"K:loss"`` makes the forward pass of step K (1-based, as in the progress lines) produce NaN, and
``"K:grad:NAME"`` makes the gradient of every parameter whose dotted path contains NAME NaN at step K.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import sys
from typing import Any, Iterable, Iterator, NamedTuple, Optional

import equinox as eqx
import jax
import jax.numpy as jnp
import levanter.tracker
import numpy as np
import optax

from qkvflow.runs.checkpoints import UnreadableCheckpoint, read_metadata, resume_hint, step_and_time
from qkvflow.training.preemption import Preemption  # noqa: F401 (part of this module's interface)

logger = logging.getLogger("qkvflow.training.faults")

INJECT_ENV = "QKVFLOW_TEST_INJECT_NONFINITE"
NONFINITE_MODES = ("stop", "skip")


class NonFiniteError(RuntimeError):
    """A training step produced a non-finite loss or gradient and `nonfinite` is `stop`."""


# --- interrupted checkpoint writes ----------------------------------------------------------------

_STEP_DIR = re.compile(r"^step-\d+$")


def incomplete_checkpoints(run_path: str, superseded_temporary: bool = True) -> list[str]:
    """`step-N` folders of a run that may be removed: those without `metadata.json` (a write that was
    interrupted), and with `superseded_temporary` temporary checkpoints older than a complete one.

    Superseded temporary checkpoints: Levanter's checkpointer (with `delete_old_temp_checkpoints`, the
    default) deletes its previous temporary checkpoint as soon as a newer save has committed; a kill
    between that commit and the deletion leaves it behind, and nothing would ever delete it (Levanter
    only remembers the newest checkpoint). Its own `metadata.json` says `is_temporary: true` and a newer
    complete checkpoint exists, so it is exactly what Levanter had decided to delete, and it is never
    loaded (resuming takes the newest). `delete_old_temp_checkpoints: false` keeps them.

    Raises `UnreadableCheckpoint` (a `UserError`, one line) if any `step-N` folder has a `metadata.json`
    that cannot be read: then nothing may be removed."""
    import fsspec

    fs, root = fsspec.core.url_to_fs(str(run_path))
    protocol = str(run_path).split("://", 1)[0] + "://" if "://" in str(run_path) else ""
    if not fs.isdir(root):
        return []
    complete, incomplete = [], []
    for entry in sorted(fs.ls(root, detail=False)):
        if not _STEP_DIR.match(os.path.basename(entry.rstrip("/"))) or not fs.isdir(entry):
            continue
        try:
            metadata = read_metadata(fs, entry)
        except UnreadableCheckpoint as e:
            raise resume_hint(e, entry, protocol) from None
        (incomplete if metadata is None else complete).append((entry, metadata))
    incomplete = [path for path, _ in incomplete]
    if complete and superseded_temporary:
        newest = max(complete, key=lambda c: step_and_time(c[1]))  # the one Levanter resumes from
        incomplete += [p for p, m in complete if m.get("is_temporary") and p != newest[0]]
    return sorted(p if p.startswith(protocol) else protocol + p for p in incomplete)


def remove_incomplete_checkpoints(run_path: str, superseded_temporary: bool = True) -> list[str]:
    """Remove what `incomplete_checkpoints` finds. Every process looks (so that an unreadable
    checkpoint stops all of them alike, instead of leaving the others waiting for process 0); then
    process 0 alone removes, and all processes wait for it."""
    found = incomplete_checkpoints(run_path, superseded_temporary)
    barrier("qkvflow_find_incomplete_checkpoints")
    removed: list[str] = []
    if jax.process_index() == 0:
        import fsspec

        for path in found:
            fs, plain = fsspec.core.url_to_fs(path)
            logger.warning(f"Removing incomplete checkpoint {path} (its write was interrupted)")
            print(f"qkvflow train: removing incomplete checkpoint {path} (its write was interrupted)", file=sys.stderr)
            fs.rm(plain, recursive=True)
            removed.append(path)
    barrier("qkvflow_remove_incomplete_checkpoints")
    return removed


def barrier(name: str) -> None:
    """Wait until every process gets here (no-op with one process)."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


# --- non-finite steps -----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Injection:
    """Testing only: poison step `step` (1-based) in the forward pass (`target="loss"`) or in the
    gradients of the parameters whose path contains `target`."""

    step: int
    target: str

    @staticmethod
    def from_env() -> Optional["Injection"]:
        spec = os.environ.get(INJECT_ENV)
        if not spec:
            return None
        step, _, target = spec.partition(":")
        if target.startswith("grad:"):
            target = target[len("grad:") :]
        elif target != "loss":
            raise ValueError(f"{INJECT_ENV}={spec!r}: expected 'K:loss' or 'K:grad:NAME'")
        return Injection(int(step), target)


def _key_name(key) -> str:
    for attr in ("name", "key", "idx"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def leaf_paths(tree) -> list[str]:
    """Dotted paths of the array leaves of `tree` (as in checkpoints), in `jax.tree.leaves` order."""
    with_path, _ = jax.tree_util.tree_flatten_with_path(tree)
    flat = jax.tree_util.FlattenedIndexKey  # a NamedArray's array inside it
    return [".".join(_key_name(k) for k in path if not isinstance(k, flat)) for path, _ in with_path]


def _gradient_paths(model) -> list[str]:
    """Paths of the leaves that `eqx.filter_value_and_grad` differentiates (the floating arrays)."""
    return leaf_paths(eqx.filter(model, eqx.is_inexact_array))


def _format(value: float) -> str:
    return f"{value:.4f}" if np.isfinite(value) else str(value)


def describe_nonfinite(
    model, loss: float, grads_finite, step: int, total: int, names: Optional[list[str]] = None
) -> str:
    """One line: which step, and where the non-finite values first appeared (parameters, then the
    loss, then the gradients). Run only when a step fired: it reads every parameter once."""
    where = f"step {step}/{total}"
    params = [
        name
        for name, leaf in zip(leaf_paths(model), jax.tree_util.tree_leaves(model))
        if eqx.is_inexact_array(leaf) and not bool(jnp.all(jnp.isfinite(leaf)))
    ]
    names = _gradient_paths(model) if names is None else names
    grads_finite = np.asarray(grads_finite).reshape(-1)
    if len(names) != grads_finite.size:  # cannot happen with Levanter's grads; be safe anyway
        names = [f"#{i}" for i in range(grads_finite.size)]
    bad = [n for n, ok in zip(names, grads_finite) if not ok]

    def listing(items):
        shown = ", ".join(items[:3])
        return shown + (f" and {len(items) - 3} more" if len(items) > 3 else "")

    if params:
        first = f"first in the parameters: {listing(params)} ({len(params)} of {len(names)} arrays non-finite before the step)"
    elif not np.isfinite(loss):
        first = f"first in the loss (the forward pass gave {loss}); {len(bad)} of {len(names)} gradient arrays are non-finite"
    else:
        first = (
            f"first in the gradients (the loss {_format(loss)} is finite): {listing(bad)} "
            f"({len(bad)} of {len(names)} gradient arrays)"
        )
    return f"non-finite values at {where}: {first}"


class GuardState(NamedTuple):
    """The optimizer state of `guard_nonfinite`: the wrapped optimizer's state and what the guard saw
    at the last update (all arrays, so it lives in `TrainerState.opt_state` and is checkpointed)."""

    inner: Any
    finite: jax.Array  # bool: the last update's loss and gradients were all finite
    grads_finite: jax.Array  # bool[number of gradient arrays]: which gradient arrays were finite
    skipped: jax.Array  # int32: updates skipped so far
    count: jax.Array  # int32: updates seen (the step the next update makes, 0-based)

    @property
    def hyperparams(self) -> dict:
        """The wrapped optimizer's injected hyperparameters (Levanter logs them, e.g. the learning rate)."""
        return getattr(self.inner, "hyperparams", {})


def guard_nonfinite(inner: optax.GradientTransformation, inject: Optional[Injection] = None):
    """`inner`, but an update whose loss or gradients are not all finite changes nothing.

    Such an update returns zero updates and keeps `inner`'s state (its step count and moments
    included), as `optax.apply_if_finite` does; unlike it, the guard never gives up after a number
    of bad steps, checks the loss as well (Levanter passes it to `update` as `loss=`), and records a
    flag per gradient array so that a report can name where the values appeared. The flags and the
    overall verdict are computed in one fused pass inside the compiled step; the host reads them from
    the new optimizer state (`NonFiniteGuard`).

    `inject` (tests only) makes the gradients of the matching parameters NaN at one step.
    """
    inner = optax.with_extra_args_support(inner)
    names: list[str] = []  # dotted paths of the gradient arrays, filled when the state is built

    def init(params):
        names[:] = leaf_paths(params)
        flags = jnp.ones((len(names),), dtype=bool)
        zero = jnp.zeros((), dtype=jnp.int32)
        return GuardState(inner.init(params), jnp.array(True), flags, zero, zero)

    def update(grads, state: GuardState, params=None, **extra):
        if inject is not None and inject.target != "loss":
            when = state.count == inject.step - 1
            leaves, treedef = jax.tree_util.tree_flatten(grads)
            leaves = [
                jnp.where(when & (inject.target in n), jnp.nan, 1.0).astype(g.dtype) * g for n, g in zip(names, leaves)
            ]
            grads = jax.tree_util.tree_unflatten(treedef, leaves)
        flags = jnp.stack([jnp.all(jnp.isfinite(g)) for g in jax.tree_util.tree_leaves(grads)])
        finite = jnp.all(flags)
        loss = extra.get("loss")
        if loss is not None:
            finite = finite & jnp.all(jnp.isfinite(loss))
        updates, new_inner = inner.update(grads, state.inner, params, **extra)
        updates = jax.tree_util.tree_map(lambda u: jnp.where(finite, u, jnp.zeros_like(u)), updates)
        kept = jax.tree_util.tree_map(lambda new, old: jnp.where(finite, new, old), new_inner, state.inner)
        skipped = state.skipped + jnp.logical_not(finite).astype(jnp.int32)
        return updates, GuardState(kept, finite, flags, skipped, state.count + 1)

    transform = optax.GradientTransformationExtraArgs(init, update)
    transform.gradient_names = names  # type: ignore[attr-defined]  (read by NonFiniteGuard)
    return transform


class NonFiniteGuard:
    """The host side of `guard_nonfinite`: after each step, reads the verdict from the optimizer state
    and either stops the run (`nonfinite: stop`, raising `NonFiniteError` naming the step and where
    the values first appeared) or records the skipped step (`nonfinite: skip`).

    Register `on_step` as the trainer's FIRST hook so that it runs before the checkpointer (nothing is
    saved for a bad step), and call `check` on every `StepInfo` the training loop yields (Levanter runs
    hooks only from its third step on)."""

    def __init__(self, optimizer, mode: str, total_steps: int, verb: str = "qkvflow train"):
        if mode not in NONFINITE_MODES:
            raise ValueError(f"nonfinite={mode!r}: expected one of {NONFINITE_MODES}")
        self.names = optimizer.gradient_names
        self.mode, self.total_steps, self.verb = mode, total_steps, verb
        self.skipped_steps: list[int] = []
        self._checked = -1

    def check(self, info) -> None:
        step = int(info.step) + 1  # 1-based: the update just made
        if step <= self._checked:
            return
        self._checked = step
        state: GuardState = info.state.opt_state
        if bool(state.finite):
            return
        flags = np.asarray(state.grads_finite)
        names = self.names if len(self.names) == flags.size else [f"#{i}" for i in range(flags.size)]
        report = describe_nonfinite(info.state.model, float(info.loss), flags, step, self.total_steps, names=names)
        if self.mode == "stop":
            raise NonFiniteError(report)
        self.skipped_steps.append(step)
        print(f"{self.verb}: skipped step {step}: {report}", file=sys.stderr, flush=True)
        logger.warning(f"Skipped step {step}: {report}")
        levanter.tracker.log({"train/skipped_steps": len(self.skipped_steps)}, step=info.step)

    def on_step(self, info, force: bool = False) -> None:
        self.check(info)


def poison_loss(loader: Iterable, start: int, inject: Optional[Injection]) -> Iterator:
    """Tests only: the batches of `loader` (the first for step `start`, 0-based), with the loss weights
    of step `inject.step` (1-based) made NaN, so that this step's forward pass gives a NaN loss."""
    for step, batch in enumerate(loader, start=start):
        if inject is not None and inject.target == "loss" and step == inject.step - 1:
            batch = dataclasses.replace(batch, loss_weight=batch.loss_weight * jnp.nan)
        yield batch
