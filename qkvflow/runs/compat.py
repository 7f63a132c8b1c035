"""One-line errors for config keys that Levanter 1.2 read and marin-levanter no longer does.

A config written for Levanter 1.2 (`trainer.fsdp_axis`, `model.seq_len`, `data.train_urls`, ...) would
otherwise fail inside draccus with a long decoding error, or, where a field was renamed, far from the
cause. `check_config` looks at the parsed YAML and the `--dotted.key value` overrides before draccus
does and raises `UserError` with one line naming the old key (its dotted path and the file or "command
line") and what to write instead:

    configs/x.yaml: trainer.fsdp_axis was removed in marin-levanter; use trainer.mesh.param_mapping (e.g. {embed: data})

Only the structural position matters: `seq_len` under `model` is flagged, a `seq_len` of the user's own
under `bench` is not. Every verb's config parsing calls `check_config(config_path, args)` before
`draccus.parse` (`config_path` may be None; `args` are the command-line overrides).
"""

from typing import Any, Iterable, Mapping, Optional, Sequence

import yaml

from qkvflow.errors import UserError

_DATA_SOURCE = "data.components.<name>.source"

# Dotted path of the old key -> what to write instead (after "use "), or, starting with "delete", the advice.
OLD_KEYS: dict[str, str] = {
    # TrainerConfig's partitioning fields became one `trainer.mesh` (levanter.utils.mesh.MeshConfig).
    "trainer.fsdp_axis": "trainer.mesh.param_mapping (e.g. {embed: data})",
    "trainer.tensor_parallel_axes": (
        "trainer.mesh.shared_mapping (e.g. {mlp: model, heads: model}) with trainer.mesh.axes.model > 1"
    ),
    "trainer.batch_axis": "trainer.mesh.batch_axis_name (and trainer.mesh.compute_mapping.batch)",
    "trainer.model_axis_size": "trainer.mesh.axes.model (e.g. {data: -1, replica: 1, model: 2})",
    "trainer.replica_ici_axis_size": "trainer.mesh.axes.replica",
    "trainer.replica_dcn_axis_size": "trainer.mesh.dcn_axes.replica_dcn",
    "trainer.axis_resources": "trainer.mesh.compute_mapping (or trainer.mesh.shared_mapping for parameters too)",
    "trainer.parameter_axis_resources": "trainer.mesh.param_mapping",
    "trainer.ray": "delete: marin-levanter starts no Ray cluster (remove the trainer.ray section)",
    "trainer.profiler_start_step": "trainer.profiler.start_step",
    "trainer.profiler_num_steps": "trainer.profiler.num_steps",
    "trainer.profiler_perfetto_link": "trainer.profiler.perfetto_link",
    # Levanter's model configs (and qkvflow's) name the context length max_seq_len.
    "model.seq_len": "model.max_seq_len",
    # UrlSingleDatasetLMConfig / HfSingleDatasetLMConfig / LMMixtureDatasetConfig became LmDataConfig,
    # whose datasets are named components with a source.
    "data.train_urls": f"{_DATA_SOURCE}.train_urls",
    "data.validation_urls": f"{_DATA_SOURCE}.validation_urls",
    "data.id": f"{_DATA_SOURCE}.id (with type: hf)",
    "data.name": f"{_DATA_SOURCE}.name (with type: hf)",
    "data.stream": f"{_DATA_SOURCE}.stream (with type: hf)",
    "data.format": "data.components.<name>.format",
    "data.tags": "data.components.<name>.tags",
    "data.configs": "data.components (one component per dataset of the mixture)",
    "data.ignore_token_id": "delete: LmDataConfig has no ignore_token_id (formats set the loss weights)",
    # qkvflow's held-out split moved with the HF source it splits.
    "data.validation_fraction": f"{_DATA_SOURCE}.validation_fraction (with type: hf_heldout)",
    "data.split_seed": f"{_DATA_SOURCE}.split_seed (with type: hf_heldout)",
}

# A key whose name stayed but whose shape changed: (path, test on the value, advice).
_OLD_SHAPES = [
    ("trainer.profiler", lambda v: isinstance(v, bool), "trainer.profiler.enabled (profiler is now a section)"),
]

# Where a config holds command-line overrides of another config (qkvflow finetune's pretrained run).
_NESTED_OVERRIDES = ("pretrained", "overrides")


def _message(source: str, key: str, advice: str) -> str:
    if advice.startswith("delete"):
        return f"{source}: {key} was removed in marin-levanter; {advice}"
    return f"{source}: {key} was removed in marin-levanter; use {advice}"


def _get(tree: Any, path: Sequence[str]) -> tuple[bool, Any]:
    for part in path:
        if not isinstance(tree, Mapping) or part not in tree:
            return False, None
        tree = tree[part]
    return True, tree


def old_keys_in_tree(tree: Any) -> list[tuple[str, str]]:
    """(dotted key, advice) for each old key at its structural position in a parsed YAML mapping."""
    found = []
    for key, advice in OLD_KEYS.items():
        if _get(tree, key.split("."))[0]:
            found.append((key, advice))
    for key, is_old, advice in _OLD_SHAPES:
        present, value = _get(tree, key.split("."))
        if present and is_old(value):
            found.append((key, advice))
    return found


def _override_keys(args: Iterable[str]) -> list[tuple[str, Optional[str]]]:
    """The dotted keys of `--a.b value` / `--a.b=value` arguments, with the value when it is inline or next."""
    args = list(args)
    keys = []
    for i, arg in enumerate(args):
        if not isinstance(arg, str) or not arg.startswith("--"):
            continue
        key, eq, value = arg[2:].partition("=")
        if not eq:
            nxt = args[i + 1] if i + 1 < len(args) else None
            value = nxt if isinstance(nxt, str) and not nxt.startswith("--") else None
        keys.append((key, value))
    return keys


def old_keys_in_overrides(args: Iterable[str]) -> list[tuple[str, str]]:
    """(dotted key as written, advice) for each override that sets an old key or a key inside one."""
    found = []
    for key, value in _override_keys(args):
        for old, advice in OLD_KEYS.items():
            if key == old or key.startswith(old + "."):
                found.append((key, advice))
                break
        else:
            for old, is_old, advice in _OLD_SHAPES:
                if key == old and value is not None and is_old(yaml.safe_load(value)):
                    found.append((key, advice))
    return found


def _raise_first(found: list[tuple[str, str]], source: str) -> None:
    if not found:
        return
    key, advice = found[0]
    message = _message(source, key, advice)
    if len(found) > 1:
        message += f" (also old: {', '.join(k for k, _ in found[1:])})"
    raise UserError(message)


def check_old_keys(tree: Any, source: str) -> None:
    """Raise UserError (one line) if the parsed YAML `tree` from `source` (a file name) uses an old key,
    including the command-line overrides a fine-tune config passes to its pretrained config."""
    _raise_first(old_keys_in_tree(tree), source)
    present, overrides = _get(tree, _NESTED_OVERRIDES)
    if present and isinstance(overrides, list):
        _raise_first(old_keys_in_overrides(overrides), f"{source}: {'.'.join(_NESTED_OVERRIDES)}")


def check_old_overrides(args: Iterable[str], source: str = "command line") -> None:
    """Raise UserError (one line) if a `--dotted.key value` override sets an old key."""
    _raise_first(old_keys_in_overrides(args), source)


def check_config(config_path: Optional[str], args: Sequence[str] = ()) -> None:
    """Check a config file (if any) and the command-line overrides for old keys, before draccus parses them.

    A file that cannot be read or parsed is left to draccus (and to the verb's own one-line errors)."""
    if config_path is not None:
        try:
            with open(config_path) as f:
                tree = yaml.safe_load(f)
        except (OSError, yaml.YAMLError, UnicodeDecodeError):
            tree = None
        check_old_keys(tree, str(config_path))
    check_old_overrides(args)
