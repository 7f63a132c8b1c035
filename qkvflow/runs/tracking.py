"""A Levanter tracker that appends every logged metric to `<path>/<run_id>/metrics.jsonl`.

Needs no account or server, survives a crash line by line, and is what `qkvflow` plots loss
curves from. A resumed run appends to the same file, after first dropping the records of the steps it
is about to train again (`drop_steps_from`: the steps a kill lost after the last checkpoint), so each
step appears once in the file.

YAML: `trainer: {tracker: {type: jsonl, path: runs}}` (a list of trackers combines it with wandb
or tensorboard).
"""

import json
import os
from dataclasses import dataclass
from typing import Any, Mapping, Optional

from levanter.tracker import Tracker
from levanter.tracker.json_logger import _to_jsonable
from levanter.tracker.tracker import TrackerConfig

from qkvflow import outputs


class JsonlTracker(Tracker):
    """A Levanter tracker that appends one JSON record per line to `file`: offline, readable, and
    safe to append to after a resume (a line cut short by a kill never swallows the next record)."""

    name: str = "jsonl"

    def __init__(self, file: str):
        self.file = file
        self._step: Optional[int] = None  # the step of the last "log" record, and the metrics logged for it
        self._logged: set = set()
        os.makedirs(os.path.dirname(file), exist_ok=True)

    def _write(self, record: dict):
        line = (json.dumps(_to_jsonable(record)) + "\n").encode()
        with open(self.file, "ab+") as f:
            size = f.seek(0, os.SEEK_END)
            if size:
                f.seek(size - 1)
                if f.read(1) != b"\n":  # a line cut short by a kill must not swallow this record
                    line = b"\n" + line
            f.write(line)

    def log_hyperparameters(self, hparams: dict[str, Any]):
        self._write({"event": "hparams", "hparams": hparams})

    def log(self, metrics: Mapping[str, Any], *, step: Optional[int], commit: Optional[bool] = None):
        if step != self._step:
            self._step, self._logged = step, set()
        elif step is not None and metrics and set(metrics) <= self._logged:
            return  # Levanter runs its hooks again after the last step: the same metrics of the same step
        self._logged.update(metrics)
        self._write({"event": "log", "step": step, "metrics": dict(metrics)})

    def log_summary(self, metrics: Mapping[str, Any]):
        self._write({"event": "summary", "metrics": dict(metrics)})

    def log_artifact(self, artifact_path, *, name: Optional[str] = None, type: Optional[str] = None):
        self._write({"event": "artifact", "path": str(artifact_path), "name": name, "type": type})

    def finish(self):
        pass


@TrackerConfig.register_subclass("jsonl")
@dataclass
class JsonlTrackerConfig(TrackerConfig):
    """`trainer.tracker: {type: jsonl, path: DIR}`: metrics go to DIR/<run id>/metrics.jsonl."""

    path: str = "runs"

    def init(self, run_id: Optional[str]):
        import jax

        if jax.process_index() != 0:  # one file per run: only process 0 writes (like Levanter's trackers)
            from levanter.tracker import NoopTracker

            return NoopTracker()
        return JsonlTracker(metrics_file(self.path, run_id or "run"))


def metrics_file(root: str, run_id: str) -> str:
    return os.path.join(root, run_id, "metrics.jsonl")


def read_metrics(file: str) -> dict[int, dict[str, float]]:
    """step -> {metric: value}, merging the records of a step; a later record wins."""
    steps: dict[int, dict[str, float]] = {}
    if not os.path.exists(file):
        return steps
    with open(file) as f:
        for line in f:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:  # a line cut short by a kill
                continue
            if record.get("event") != "log" or record.get("step") is None:
                continue
            numeric = {k: v for k, v in record["metrics"].items() if isinstance(v, (int, float))}
            steps.setdefault(int(record["step"]), {}).update(numeric)
    return steps


def drop_steps_from(file: str, start: int) -> int:
    """Remove the "log" records of steps >= `start` (0-based, as logged) from `file`, and lines cut
    short by a kill; keep everything else (hparams, summaries, artifacts). Called by a run that
    resumes at step `start`, before it logs again. The file is rewritten atomically (`qkvflow.outputs.replace_whole`), so a kill during the rewrite leaves the old or the new file.
    Returns the number of lines dropped."""
    if not os.path.exists(file):
        return 0
    kept, dropped = [], 0
    with open(file, "rb") as f:
        for line in f:
            try:
                record = json.loads(line)
            except (json.JSONDecodeError, UnicodeDecodeError):
                dropped += 1
                continue
            step = record.get("step") if isinstance(record, dict) else None
            if isinstance(record, dict) and record.get("event") == "log" and step is not None and int(step) >= start:
                dropped += 1
                continue
            kept.append(line if line.endswith(b"\n") else line + b"\n")
    if dropped:
        outputs.replace_whole(file, b"".join(kept))
    return dropped
