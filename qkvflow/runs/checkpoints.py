"""A checkpoint of a `qkvflow train` run: which step folder a checkpoint argument means (`newest_step`),
its model read back (`load_model`), and one-line messages for a checkpoint Levanter cannot restore:
which arrays are missing, which file is damaged, and what to do (`restore_error`, also for resuming runs).

The verbs load a run's model through `qkvflow.runs.model` (which adds fine-tuning runs);
fine-tuning loads its pretrained run from here.
"""

import json
import os
import re
import sys
from typing import Optional

import equinox as eqx
import jax
import jax.random as jrandom
import levanter.checkpoint
import numpy as np
from haliax import Axis

from qkvflow.errors import UserError
from qkvflow.models import layout
from qkvflow.runs.checkpoint_arrays import array_shapes
from qkvflow.runs.config import TrainConfig
from qkvflow.runs.corpus import with_corpus


class UnreadableCheckpoint(UserError):
    """A `step-N` folder with a `metadata.json` that cannot be read: it is not removed."""


def read_metadata(fs, path: str) -> Optional[dict]:
    """The checkpoint's metadata; None if it has no `metadata.json` (an interrupted write);
    `UnreadableCheckpoint` if the file is there but unreadable or lacks a usable `step`/`timestamp`."""
    file = os.path.join(path, "metadata.json")
    try:
        with fs.open(file) as f:
            metadata = json.load(f)
    except FileNotFoundError:
        # listed in its folder but not found: e.g. a symbolic link to a file that is gone (fsspec's
        # `exists` follows links, so it says False for a dangling one, as if nothing were there)
        if any(os.path.basename(p.rstrip("/")) == "metadata.json" for p in fs.ls(path, detail=False)):
            problem = "cannot be opened (a symbolic link to a missing file?)"
        else:
            return None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        problem = f"is not valid JSON ({e})"
    except OSError as e:
        problem = f"cannot be read ({e.strerror or e})"
    else:
        if step_and_time(metadata) is not None:
            return metadata
        problem = "has no integer `step` and ISO-format `timestamp`"
    raise UnreadableCheckpoint(
        f"checkpoint {path}: its metadata.json {problem}; its arrays may be complete, so it was not removed"
    )


def step_and_time(metadata) -> Optional[tuple]:
    """(step, timestamp) as Levanter reads them to find the newest checkpoint (an int step and an
    ISO-format timestamp; it silently passes over a folder without them), or None."""
    import datetime

    try:
        return int(metadata["step"]), datetime.datetime.fromisoformat(metadata["timestamp"])
    except (TypeError, KeyError, ValueError):
        return None


def resume_hint(error: UnreadableCheckpoint, path: str, protocol: str) -> UnreadableCheckpoint:
    run, name = os.path.split(path.rstrip("/"))
    aside = f"{protocol}{run}.{name}.unreadable"
    return UnreadableCheckpoint(
        f"{error}: move it out of the run folder (e.g. `mv {protocol}{path} {aside}`) and run again to resume "
        "from the newest earlier checkpoint"
    )


def newest_step(checkpoint: str, name: str = "checkpoint") -> str:
    """The folder to load: `checkpoint` itself when it is a step (it holds `metadata.json`), else the newest
    complete step of the run folder `checkpoint` (Levanter's `discover_latest_checkpoint`). UserError if
    there is none, and `UnreadableCheckpoint` (with `train`'s message) when `checkpoint` or any
    folder in it has a `metadata.json` that cannot be read: Levanter would log a traceback and pass over it.
    `name` is how messages call the argument (e.g. "--checkpoint")."""
    import fsspec

    checkpoint = str(checkpoint)
    fs, root = fsspec.core.url_to_fs(checkpoint)
    protocol = checkpoint.split("://", 1)[0] + "://" if "://" in checkpoint else ""
    candidates = [root] + (sorted(e for e in fs.ls(root, detail=False) if fs.isdir(e)) if fs.isdir(root) else [])
    for folder in candidates:
        try:
            read_metadata(fs, folder)
        except UnreadableCheckpoint as e:
            raise resume_hint(e, folder, protocol) from None
    path = levanter.checkpoint.discover_latest_checkpoint(checkpoint)
    if path is None:
        raise UserError(f"{name} {checkpoint!r}: no checkpoint found (expected checkpoints/<run_id>[/step-N])")
    return path


def _holds_per_weight_layout(shape, path: str) -> bool:
    """Whether the checkpoint `path` holds a DiffEqFormer's hypernetworks per weight (the layout before
    stacking, `qkvflow.models.layout`) where the model `shape` stacks them."""
    if not layout.is_stacked(shape):
        return False
    try:
        return layout.holds_per_weight(array_shapes(path))
    except Exception:  # noqa: BLE001  (unreadable metadata: Levanter's restore below names the problem)
        return False


def loaded(path: str) -> None:
    """Say which step folder a verb loaded (stderr: stdout is the verb's own output)."""
    print(f"loaded checkpoint {path}", file=sys.stderr, flush=True)


def load_model(config: TrainConfig, checkpoint: str, *, vocab_size: int | None = None, announce: bool = True):
    """(model, tokenizer) of a `qkvflow train` checkpoint of `config`'s run (`newest_step(checkpoint)`):
    only the `model` subtree of the trainer state, in the shape that the run's config builds, on the local
    devices.

    A DiffEqFormer checkpoint written before the hypernetworks were stacked is read in its own layout
    and converted (`qkvflow.models.layout`); the model is the same.

    The tokenizer is the Hugging Face one (Levanter loads a `MarinTokenizer`; exports and prompts need
    the transformers API). The vocabulary size comes from it unless `vocab_size` is given.
    """
    config = with_corpus(config)
    tokenizer = config.data.the_tokenizer
    if hasattr(tokenizer, "as_hf_tokenizer"):
        tokenizer = tokenizer.as_hf_tokenizer()
    path = newest_step(checkpoint)
    Vocab = Axis("vocab", vocab_size or len(tokenizer))
    shape = eqx.filter_eval_shape(config.model.build, Vocab, key=jrandom.PRNGKey(0))
    previous = _holds_per_weight_layout(shape, path)
    if previous:  # written before the hypernetworks were stacked: read that layout, then stack it
        shape = layout.per_weight_shape(config.model.build, Vocab, key=jrandom.PRNGKey(0))
    # Levanter's restore places every array on a mesh (it needs one active); unmapped axes: replicated.
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("data",))
    try:
        with jax.set_mesh(mesh):
            model = levanter.checkpoint.load_checkpoint(shape, path, subpath="model", mesh=mesh)
            if previous:
                model = layout.stacked_model(model)
    except (KeyError, ValueError, FileNotFoundError) as e:
        absent = missing_arrays(path, e)
        other = absent and other_variant(config.model, path, Vocab)
        if other:  # the run's model with the other `variant`: name the config key (issue 56)
            raise UserError(
                f"checkpoint {path!r} holds a model of model.variant={other!r} but the config has "
                f"model.variant={config.model.variant!r}: pass --model.variant {other} (the run's variant)"
            ) from None
        if absent:  # most likely another model: name it rather than suggest resume options
            raise UserError(
                f"checkpoint {path!r} does not hold a {type(config.model).__name__} model as the config describes: "
                f"it lacks {len(absent)} of its arrays ({name_some(absent)}); expected a checkpoint of this config's run"
            ) from None
        error = restore_error(path, e, advice="use an earlier step-N folder of the run")
        if error is not None:
            raise error from None
        raise UserError(
            f"checkpoint {path!r} does not hold a {type(config.model).__name__} model with vocabulary "
            f"{Vocab.size} as the config describes ({type(e).__name__}: {str(e).splitlines()[0][:200]})"
        ) from e
    if announce:
        loaded(path)
    return model, tokenizer


def other_variant(model_config, checkpoint: str, Vocab: Axis) -> str | None:
    """The other `model.variant` (qkvflow or official) whose arrays `checkpoint` holds, all of them, when
    `model_config` names one and its own arrays are missing; None otherwise (read from array names alone)."""
    import dataclasses

    from levanter.utils.jax_utils import leaf_key_paths

    variant = getattr(model_config, "variant", None)
    if variant is None:
        return None
    stored = {name.removeprefix("model/").replace("/", ".") for name in array_shapes(checkpoint)}
    for other in ("qkvflow", "official"):
        if other == variant:
            continue
        try:
            shape = eqx.filter_eval_shape(
                dataclasses.replace(model_config, variant=other).build, Vocab, key=jrandom.PRNGKey(0)
            )
        except Exception:  # noqa: BLE001 (a config the other variant refuses, e.g. a Llama flavour)
            continue
        names = {p for p in jax.tree_util.tree_leaves(leaf_key_paths(shape)) if isinstance(p, str)}
        if names and names <= stored:
            return other
    return None


SHOWN = 3
"""How many array names a message lists before "and N more"."""


def _names(root: str, paths) -> list[str]:
    """Checkpoint file paths as the arrays' dotted names (`model.token_embeddings.weight`)."""
    root = root.rstrip("/") + "/"
    return [p.removeprefix(root).strip("/").replace("/", ".") for p in paths]


def name_some(names, shown: int = SHOWN) -> str:
    """`a, b, c and 167 more`: a list capped at `shown` names."""
    names = list(names)
    head = ", ".join(names[:shown])
    return head + (f" and {len(names) - shown} more" if len(names) > shown else "")


def missing_arrays(checkpoint: str, error: BaseException) -> list[str]:
    """The dotted names of the arrays Levanter's restore reported missing from `checkpoint` (its
    `FileNotFoundError` lists every path: absolute ones for a checkpoint of a folder per array, as
    Levanter 1.2 wrote, relative ones for marin-levanter's OCDBT database), or [] if `error` is not that."""
    missing = re.search(r"Missing[^\[]*\[(.*?)\]", str(error), re.DOTALL)
    if not (isinstance(error, FileNotFoundError) and missing):
        return []
    return _names(str(checkpoint), re.findall(r"'([^']+)'", missing.group(1)))


def _present_groups(checkpoint: str, message: str) -> set[str]:
    """Top-level entries (model, opt_state, ...) that `checkpoint` holds: from the keys an OCDBT
    restore error lists after "Found:", else from the folders of a folder-per-array checkpoint."""
    found = re.search(r"Found: \{(.*)\}", message, re.DOTALL)
    if found:
        return {key.split("/")[0] for key in re.findall(r"'([^']+)'", found.group(1))}
    return set(os.listdir(checkpoint)) if os.path.isdir(checkpoint) else set()


TRAIN_ADVICE = "resume from an earlier step-N with trainer.load_checkpoint_path, or use a new trainer.id"

_OCDBT_READ = re.compile(r'Error reading "([^"]+)" in OCDBT database at [^"]*"([^"]+)":\s*(.*)', re.DOTALL)
"""tensorstore's error for an unreadable value of an OCDBT checkpoint: the array's chunk key, the database."""


def restore_error(checkpoint: str, error: BaseException, advice: str = TRAIN_ADVICE) -> UserError | None:
    """A one-line `UserError` for a checkpoint Levanter could not restore, or None if `error` is not
    about the files of `checkpoint`.

    Levanter reports missing arrays as one exception listing every path (170 for a checkpoint
    without optimizer state) and damaged data as tensorstore's error: with the chunk's key (e.g.
    `model/token_embeddings/weight/c/0/0`) for marin-levanter's OCDBT checkpoints, with the chunk
    file's path for Levanter 1.2's folder per array, or with the path of a damaged OCDBT database
    file (`d/...`, `manifest.ocdbt`). This names the checkpoint, the arrays (at most SHOWN) or the
    file, and what the user can do (`advice`, for damaged data).
    """
    checkpoint = str(checkpoint)
    message = str(error)
    names = missing_arrays(checkpoint, error)
    if names:
        present = _present_groups(checkpoint, message)
        absent = sorted({n.split(".")[0] for n in names} - present)
        whole = f" (no {' or '.join(absent)} at all)" if absent else ""
        return UserError(
            f"checkpoint {checkpoint!r} lacks {len(names)} arrays that this run restores{whole}: {name_some(names)}; "
            "set trainer.allow_partial_checkpoint=true to initialise the missing ones, or use a new trainer.id"
        )
    if not isinstance(error, ValueError):
        return None
    ocdbt = _OCDBT_READ.search(message)
    if ocdbt and os.path.abspath(ocdbt.group(2)).rstrip("/").startswith(os.path.abspath(checkpoint).rstrip("/")):
        key = ocdbt.group(1)
        if key.endswith("/zarr.json"):  # the array's metadata
            array, part = key.removesuffix("/zarr.json"), "its metadata (zarr.json)"
        else:  # a chunk: <array>/c/<i>/<j>/...
            array, _, chunk = key.partition("/c/")
            part = f"its chunk {chunk!r}"
        return UserError(
            f"checkpoint {checkpoint!r}: array {_names('', [array])[0]} cannot be read, {part} is "
            f"damaged ({_first_line(ocdbt.group(3), error)}); {advice}"
        )
    damaged = re.search(
        r"[\"']((?:file://)?" + re.escape(checkpoint.rstrip("/")) + r"/[^\"']+)[\"'][:;,]?\s*(.*)", message
    )
    if damaged:
        file = damaged.group(1).removeprefix("file://")
        relative = os.path.relpath(file, checkpoint)
        why = _first_line(damaged.group(2), error)
        if relative == "manifest.ocdbt" or relative.startswith("d/"):
            return UserError(
                f"checkpoint {checkpoint!r}: its OCDBT database file {relative!r} is damaged ({why}); {advice}"
            )
        array, chunk = os.path.split(file)
        return UserError(
            f"checkpoint {checkpoint!r}: array {_names(checkpoint, [array])[0]} cannot be read, its chunk file "
            f"{chunk!r} is damaged ({why}); {advice}"
        )
    return None


def _first_line(text: str, error: BaseException) -> str:
    """The start of tensorstore's reason, without its source locations; the error's type if none."""
    text = re.split(r"\s*\[(?:source locations|tensorstore_spec)=", text)[0].strip()
    return text.splitlines()[0][:160].strip() if text else type(error).__name__
