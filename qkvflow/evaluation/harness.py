"""EleutherAI's lm-evaluation-harness on qkvflow checkpoints, through Levanter's harness.

`run` hands the model to `levanter.eval_harness.run_lm_eval_harness` (public), which packs the
requests into sequences of the model's context and scores them with `model.activations`. Three
things are added around it:

* Positions restart at every packed request. Levanter packs up to 64 requests into one sequence and
  calls `activations(tokens, attn_mask)` without positions, so a model with learned absolute
  positions (GPT-2 and the GPT-2-flavour DiffEqFormer) would see the k-th request at positions
  offset by the requests before it, and score it differently from the same request alone.
  `SegmentPositions` wraps the model and passes `pos_ids` = the offset of each token within its
  segment (from the mask's segment ids), the positions the request has when scored alone.
* Tasks are loaded once before Levanter's loader runs, without retries: Levanter's `to_task_dict`
  retries every failure 10 times with exponential backoff (5 s up to 300 s), so a wrong task file or
  an unreachable dataset would hang for half an hour; here it fails at once in one line. A path
  ending in .yaml/.yml is read as a task definition (lm-eval's YAML keys, e.g. `dataset_path: json`
  with `dataset_kwargs: {data_files: ...}`); its local data files must exist.
* lm-eval's index of its built-in tasks (about 15,000 YAML files, 12-18 s to build on the 2-core VM) is
  built once per process (`task_manager`) and shared by the preload and by Levanter's loader for every
  grid of a `qkvflow eval --tasks ... --steps ...` call (`shared_task_manager`), where each built its own;
  a call whose tasks are all task files builds none (`needs_index`).
* `loglikelihood_rolling` (wikitext-style perplexity tasks), which Levanter's harness raises on
  (checked in tests/evaluation/test_harness.py), runs with lm-eval's window rules
  (qkvflow.evaluation.rolling). `generate_until` needs a KV-cache decoder inside Levanter's harness
  that the DiffEqFormer does not have there: such tasks are refused in one line. Perplexity of a
  whole corpus is `qkvflow eval` without --tasks.
"""

from __future__ import annotations

import contextlib
import functools
import os
from typing import Optional

import equinox as eqx
import haliax as hax
import jax
import jax.numpy as jnp

from qkvflow.errors import UserError
from qkvflow.evaluation import rolling

INSTALL = "pip install 'qkvflow[eval]'"
SUPPORTED = ("loglikelihood", "multiple_choice", "loglikelihood_rolling")


def check_installed() -> None:
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        raise UserError(f"--tasks needs lm-evaluation-harness, which is not installed: {INSTALL}") from None


def _read_task_file(path: str) -> dict:
    import yaml

    try:
        with open(path) as f:
            spec = yaml.safe_load(f)
    except (OSError, yaml.YAMLError) as e:
        raise UserError(f"--tasks {path}: cannot be read as YAML ({str(e).splitlines()[0]})") from None
    if not isinstance(spec, dict) or not isinstance(spec.get("task"), str):
        raise UserError(f"--tasks {path}: expected a task definition (a mapping with a `task` name)")
    kwargs = spec.get("dataset_kwargs") or {}
    files = kwargs.get("data_files")
    if files is not None:
        base = os.path.dirname(os.path.abspath(path))

        def local(f):
            if "://" in str(f):
                return f
            full = os.path.join(base, os.path.expanduser(str(f)))
            if not os.path.exists(full):
                raise UserError(
                    f"--tasks {path}: dataset_kwargs.data_files {f!r} does not exist (relative to the task file)"
                )
            if _is_blank(full):
                raise UserError(
                    f"--tasks {path}: dataset_kwargs.data_files {f!r} is empty: expected the task's documents "
                    "(for `dataset_path: json`, one JSON object per line)"
                )
            return full

        if isinstance(files, dict):
            files = {k: [local(f) for f in v] if isinstance(v, list) else local(v) for k, v in files.items()}
        else:
            files = [local(f) for f in files] if isinstance(files, list) else local(files)
        spec = {**spec, "dataset_kwargs": {**kwargs, "data_files": files}}
    return spec


def _is_blank(path: str) -> bool:
    """Whether the file at `path` holds nothing but white space (lm-eval then fails with a bare StopIteration)."""
    if os.path.isdir(path):
        return False
    with open(path, "rb") as f:
        while chunk := f.read(1 << 16):
            if chunk.strip():
                return False
    return True


def task_names(text: str) -> list[str]:
    """`arc_easy, my_task.yaml` -> ["arc_easy", "my_task.yaml"]; an empty item (`--tasks ","`, `a,,b`) is
    refused in one line."""
    items = [s.strip() for s in str(text).split(",")]
    if not items or any(not s for s in items):
        raise UserError(
            f"--tasks {text!r} is invalid: expected comma-separated task names or task YAML files (e.g. arc_easy,piqa)"
        )
    return items


def task_spec(text: str) -> list:
    """`arc_easy,my_task.yaml` -> ["arc_easy", {task definition}]. A task file's `output_type`, when it
    names one, is checked here, before lm-eval loads (and downloads or builds) the task's data."""
    spec = [_read_task_file(s) if s.endswith((".yaml", ".yml")) else s for s in task_names(text)]
    for item in spec:
        if isinstance(item, dict) and item.get("output_type") not in (None, *SUPPORTED):
            _refuse_kind(item["task"], item["output_type"])
    return spec


def _refuse_kind(name: str, kind: str):
    raise UserError(
        f"--tasks: task {name!r} needs {kind}, which Levanter's harness does not run for qkvflow models "
        f"(supported: {', '.join(SUPPORTED)}); corpus perplexity is `qkvflow eval` without --tasks"
    )


def _tasks(task_dict) -> list:
    out = []
    for value in task_dict.values():
        out += _tasks(value) if isinstance(value, dict) else [value]
    return out


def preload(spec: list) -> None:
    """Load every task once with lm-eval, without retries, and refuse what cannot run (one line).
    Relative `data_files` of a task file are made absolute (relative to the file) by `task_spec`."""
    import lm_eval.tasks as tasks

    manager = task_manager(needs_index(spec))
    for item in spec:
        name = item if isinstance(item, str) else item["task"]
        try:
            with _no_progress_bars():
                loaded = tasks.get_task_dict([item], manager)
        except Exception as e:  # noqa: BLE001 (lm-eval and datasets raise many kinds)
            first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
            if isinstance(e, StopIteration):  # what lm-eval raises on a dataset without documents
                raise UserError(
                    f"--tasks: task {name!r} has no documents: expected a dataset with at least one"
                ) from None
            raise UserError(f"--tasks: task {name!r} could not be loaded ({type(e).__name__}: {first})") from None
        for task in _tasks(loaded):
            if task.OUTPUT_TYPE not in SUPPORTED:
                _refuse_kind(name, task.OUTPUT_TYPE)


@contextlib.contextmanager
def _no_progress_bars():
    """Hugging Face datasets' progress bars off while the tasks are checked: the terminal shows the verb's
    own output and its one-line refusals, not the building of a dataset that may then be refused."""
    from datasets.utils import logging as datasets_logging

    was = datasets_logging.is_progress_bar_enabled()
    datasets_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            datasets_logging.enable_progress_bar()


@functools.cache
def task_manager(builtin: bool = True):
    """lm-eval's `TaskManager()`: the index of every built-in task, built once per process; with
    `builtin=False` an empty index (`include_defaults=False`), enough for task definitions alone
    (`needs_index`). It is not changed by loading tasks (each load builds its tasks afresh), so one
    serves every load."""
    import lm_eval.tasks as tasks

    return tasks.TaskManager() if builtin else tasks.TaskManager(include_defaults=False)


def needs_index(spec: list) -> bool:
    """Whether loading `spec` (`task_spec`'s list) needs lm-eval's index of its built-in tasks. A task name
    does, and so does a group (its members are looked up there); a task definition (a mapping with a
    `task` name and no `group`) is built from its own keys alone (lm-eval 0.4's `TaskManager._load_spec`),
    so a call that only names task files skips the 12-18 s of building the index.
    tests/evaluation/test_harness.py loads a task file with each index and compares."""
    return any(isinstance(item, str) or "group" in item for item in spec)


@contextlib.contextmanager
def shared_task_manager(builtin: bool = True):
    """Within the block, `lm_eval.tasks.TaskManager()` without arguments, which Levanter's
    `LmEvalHarnessConfig.to_task_dict` calls once per run, gives `task_manager(builtin)`'s instead of
    indexing every task again; with arguments it builds one as before. It replaces the module attribute
    that Levanter's call looks up; tests/evaluation/test_harness.py fails when Levanter stops calling it
    so."""
    import lm_eval.tasks as tasks

    original, shared = tasks.TaskManager, task_manager(builtin)

    def manager(*args, **kwargs):
        return original(*args, **kwargs) if args or kwargs else shared

    tasks.TaskManager = manager
    try:
        yield
    finally:
        tasks.TaskManager = original


class SegmentPositions(eqx.Module):
    """`model` whose `activations` numbers the positions of each packed segment from 0 (see the module
    docstring). Everything else the harness uses is the model's."""

    model: eqx.Module

    def __getattr__(self, name):
        if name == "model":  # not set yet (during construction)
            raise AttributeError(name)
        return getattr(self.model, name)

    def get_lm_head(self):
        return self.model.get_lm_head()

    def activations(self, input_ids, attn_mask=None, *, key=None, pos_ids=None):
        segments = getattr(attn_mask, "segment_ids", None)
        if pos_ids is None and segments is not None:
            pos_ids = segment_positions(segments[0] if isinstance(segments, tuple) else segments, self.model.Pos.name)
        return self.model.activations(input_ids, attn_mask, key=key, pos_ids=pos_ids)


def segment_positions(segment_ids: hax.NamedArray, pos_name: str) -> hax.NamedArray:
    """pos[i] = i - (first index of i's segment), segments being runs of equal ids along `pos_name`."""
    axis = segment_ids.axis_indices(pos_name)
    ids = segment_ids.array
    index = jax.lax.broadcasted_iota(jnp.int32, ids.shape, axis)
    previous = jnp.roll(ids, 1, axis=axis)
    starts = jnp.where(ids != previous, index, 0)  # index 0 gives 0 either way
    return hax.named(index - jax.lax.cummax(starts, axis=axis), segment_ids.axes)


def run(model, config, spec: list, max_examples: Optional[int] = None, *, log_samples: bool = False) -> dict:
    """lm-eval's results dict (`results`, `n-samples`, ..., Levanter's `averages`; `samples` with log_samples).
    Call `preload(spec)` first (qkvflow eval does, before loading the model)."""
    from levanter.eval_harness import LmEvalHarnessConfig, run_lm_eval_harness

    t = config.trainer
    harness_config = LmEvalHarnessConfig(task_spec=spec, max_examples=max_examples, log_samples=log_samples)
    with hax.partitioning.set_mesh(t.device_mesh), hax.axis_mapping(t.parameter_axis_mapping):
        model = hax.shard(SegmentPositions(model), t.parameter_axis_mapping)  # onto the trainer's mesh
        with rolling.enabled(), shared_task_manager(needs_index(spec)):
            return run_lm_eval_harness(
                harness_config, model, config.data.the_tokenizer, t.EvalBatch, t.compute_axis_mapping, t.mp
            )


def summary_table(runs: list[dict]) -> str:
    """Markdown: one row per run (a solver grid of `qkvflow eval`, labelled by its `solver`, `grid` and
    `trained` keys), task and metric, with lm-eval's stderr beside it when it computed one (the
    example count Levanter adds as `sample_len` is not a metric, and is in `n-samples`)."""
    lines = ["| solver | steps or tolerance | task | metric | value | stderr |", "|---|---|---|---|---|---|"]
    for run in runs:
        grid = run["grid"] + (" (trained)" if run.get("trained") else "")
        for task, metrics in sorted((run or {}).get("results", {}).items()):
            for key, value in sorted(metrics.items()):
                if "stderr" in key or key in ("alias", "sample_len") or not isinstance(value, (int, float)):
                    continue
                metric, _, filt = key.partition(",")
                err = metrics.get(f"{metric}_stderr,{filt}") if filt else metrics.get(f"{metric}_stderr")
                err_text = f"{err:.4f}" if isinstance(err, (int, float)) else "-"
                lines.append(f"| {run['solver']} | {grid} | {task} | {metric} | {value:.4f} | {err_text} |")
    return "\n".join(lines)
