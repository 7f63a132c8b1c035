"""`run_folder` (qkvflow.runs.model): the run folder a `--checkpoint` argument belongs to, which eval,
generate and export write nothing into. A step folder stands for its run: the run folder is its parent."""

import json

import pytest

from qkvflow.errors import UserError
from qkvflow.outputs import check_outside
from qkvflow.runs.model import run_folder


def _run(tmp_path):
    run = tmp_path / "checkpoints" / "tiny"
    for step in (4, 8):
        (run / f"step-{step}").mkdir(parents=True)
        metadata = {"step": step, "timestamp": "2026-11-29T00:00:00"}
        (run / f"step-{step}" / "metadata.json").write_text(json.dumps(metadata))
    return run


def test_a_step_folder_stands_for_its_run(tmp_path, monkeypatch):
    run = _run(tmp_path)
    for argument in (run / "step-8", f"{run / 'step-4'}/", run, f"{run}/"):
        assert run_folder(str(argument)) == str(run), argument
    monkeypatch.chdir(tmp_path)
    assert run_folder("checkpoints/tiny/step-8") == "checkpoints/tiny"
    monkeypatch.setenv("HOME", str(tmp_path))
    assert run_folder("~/checkpoints/tiny/step-8") == str(run)


def test_an_output_beside_the_step_folder_given_is_inside_the_run_and_refused(tmp_path):
    """`--checkpoint checkpoints/tiny/step-8 --output checkpoints/tiny/exp`: the output lies outside the step
    folder but inside the run (beside its other steps), and is refused as the verbs refuse it."""
    run = _run(tmp_path)
    outside = [("the run folder of --checkpoint", run_folder(str(run / "step-8")))]
    with pytest.raises(UserError, match="is inside the run folder of --checkpoint"):
        check_outside(str(run / "exp"), "--output", outside)
    check_outside(str(tmp_path / "exp"), "--output", outside)  # outside the run: fine
