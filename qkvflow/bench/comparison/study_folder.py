"""The work folder of a `qkvflow bench compare` study, and where its outputs may not go.

`claim` marks a folder as one study's (`study.json`: the base config, the budget and each model's
definition). An invocation on a folder that holds `study.json` continues that study when the base and
the budget are the same and every model that has runs there is defined as before; a model that has no
run there yet (no config, result or checkpoint of `<model>-lr<rate>-s<seed>`) may be added or redefined,
and its record is updated. Anything else is refused in one line that says how to start over. A folder
without `study.json` must be empty or absent.

Outputs stay out of the repository's tracked folders (`qkvflow.outputs.check_outside_repository`):
a report written under `benchmarks/results/` would mix with the results the repository ships.
"""

import json
import os
import re
from pathlib import Path

from qkvflow.errors import UserError
from qkvflow.outputs import check_writable


def has_runs(workdir: Path, model: str) -> bool:
    """Whether `model` has a run config, result or checkpoint in the study folder `workdir`."""
    run = re.compile(rf"{re.escape(model)}-lr[0-9.e+-]+-s\d+(\.test)?(\.yaml|\.json)?")
    places = (workdir / "configs", workdir / "results", workdir / "checkpoints")
    return any(run.fullmatch(p.name) for place in places if place.is_dir() for p in place.iterdir())


def claim(workdir: Path, mine: dict) -> None:
    """Mark `workdir` as the study whose identity is `mine` ({"base", "iters", "models"}), or continue it."""
    marker = workdir / "study.json"
    if marker.is_file():
        held = json.loads(marker.read_text())
        if (held["base"], held["iters"]) != (mine["base"], mine["iters"]):
            raise UserError(
                f"--workdir {workdir} holds another study (its study.json differs in base or iters): use a new "
                "--workdir to start over"
            )
        changed = [m for m in mine["models"] if m in held["models"] and held["models"][m] != mine["models"][m]]
        ran = [m for m in changed if has_runs(workdir, m)]
        if ran:
            raise UserError(
                f"--workdir {workdir} holds another study (its study.json differs in model {ran[0]!r}, which has "
                f"runs there): give the changed model a new name in the study, or use a new --workdir to start over"
            )
        if any(held["models"].get(m) != mine["models"][m] for m in mine["models"]):  # added, or redefined unrun
            held["models"] = {**held["models"], **mine["models"]}
            write_json(marker, held)
        return
    if workdir.exists() and any(workdir.iterdir()):
        raise UserError(f"--workdir {workdir} is not empty and holds no study.json: choose a new or empty folder")
    check_writable(str(workdir), "--workdir")
    workdir.mkdir(parents=True, exist_ok=True)
    marker.write_text(json.dumps(mine, indent=1) + "\n")


def write_json(path: Path, value: dict) -> None:
    """`value` written to `path` whole (a temporary file, then renamed): a reader sees it whole or absent."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(value, indent=1) + "\n")
    os.replace(tmp, path)
