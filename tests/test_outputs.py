"""qkvflow.outputs: the write probe and the safe replacement of output folders, in-process.

Every refusal must be one line naming the key and the path, and leave every file where it was.
"""

import json
import os
from pathlib import Path

import pytest

from qkvflow.errors import UserError
from qkvflow.outputs import MARKER, check_replaceable, check_writable, replacing


def _tree(folder: Path) -> dict:
    """Every file under `folder` with its bytes: what must survive a refusal unchanged."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _refusal(call, *needles) -> str:
    with pytest.raises(UserError) as info:
        call()
    message = str(info.value)
    assert "\n" not in message
    for needle in needles:
        assert needle in message, message
    return message


def _write(folder: str, **files) -> None:
    for name, text in files.items():
        Path(folder, name).write_text(text)


@pytest.fixture
def world(tmp_path, monkeypatch):
    """cwd = tmp/work/here, with a checkpoint and a config of the user's in tmp/work."""
    work = tmp_path / "work"
    (work / "here").mkdir(parents=True)
    (work / "here" / "notes.txt").write_text("mine")
    (work / "checkpoints" / "run" / "step-2").mkdir(parents=True)
    (work / "checkpoints" / "run" / "step-2" / "metadata.json").write_text("{}")
    (work / "configs").mkdir()
    (work / "configs" / "run.yaml").write_text("model: {}\n")
    monkeypatch.chdir(work / "here")
    return work


def test_protected_folders_are_refused_and_left_alone(world, tmp_path):
    protect = [
        ("--checkpoint", str(world / "checkpoints" / "run")),
        ("--config_path", str(world / "configs" / "run.yaml")),
    ]
    before = _tree(tmp_path)
    cases = {
        ".": "is or holds the current folder",
        str(world): "is or holds the current folder",  # an ancestor of the current folder
        "/": "is or holds the current folder",
        "~": "is or holds your home folder",
        str(world / "checkpoints"): "is or holds --checkpoint",
        str(world / "checkpoints" / "run"): "is or holds --checkpoint",
        str(world / "configs"): "is or holds --config_path",
    }
    for path, reason in cases.items():
        for overwrite in (True, False):
            _refusal(
                lambda p=path, o=overwrite: check_replaceable(
                    p, kind="hf_export", key="--output", overwrite=o, protect=protect
                ),
                f"--output={path!r}",
                reason,
            )
            with pytest.raises(UserError), replacing(path, kind="hf_export", key="--output", protect=protect):
                raise AssertionError("the writer must not run")
    assert _tree(tmp_path) == before
    assert sorted(p.name for p in world.iterdir()) == ["checkpoints", "configs", "here"]  # no temporary sibling


def test_folders_qkvflow_did_not_write_are_refused(world):
    foreign = world / "theirs"
    foreign.mkdir()
    (foreign / "thesis.tex").write_text("years of work")
    _refusal(
        lambda: check_replaceable(str(foreign), kind="hf_export", key="--output"),
        "is not empty and was not written by qkvflow",
        f"no readable {MARKER}",
        "remove it yourself",
    )
    a_file = world / "file.txt"
    a_file.write_text("x")
    _refusal(lambda: check_replaceable(str(a_file), kind="hf_export", key="--output"), "is a file")
    os.symlink(foreign, world / "link")
    _refusal(lambda: check_replaceable(str(world / "link"), kind="hf_export", key="--output"), "is a symbolic link")

    # an earlier output, into which the user has since put a file of their own
    out = world / "export"
    with replacing(str(out), kind="hf_export", key="--output") as folder:
        _write(folder, **{"model.safetensors": "w1"})
    (out / "README.md").write_text("my notes")
    _refusal(
        lambda: check_replaceable(str(out), kind="hf_export", key="--output"), "holds 'README.md'", "did not write"
    )
    _refusal(
        lambda: check_replaceable(str(out), kind="sweep", key="sweep.out_dir"), "holds a qkvflow hf_export, not a sweep"
    )
    assert (foreign / "thesis.tex").read_text() == "years of work" and (out / "README.md").read_text() == "my notes"


def test_an_earlier_output_is_swapped_for_the_new_one(world):
    out = world / "exports" / "m"
    with replacing(str(out), kind="hf_export", key="--output", overwrite=False) as folder:
        assert Path(folder).parent == out.parent and folder != str(out)
        _write(folder, **{"config.json": "{}", "model.safetensors": "old"})
        os.makedirs(os.path.join(folder, "ode"))
        _write(os.path.join(folder, "ode"), **{"weights.safetensors": "ode"})
    marker = json.loads((out / MARKER).read_text())
    assert marker["kind"] == "hf_export" and marker["files"] == [
        "config.json",
        "model.safetensors",
        "ode/weights.safetensors",
    ]
    _refusal(lambda: check_replaceable(str(out), kind="hf_export", key="--output", overwrite=False), "pass --overwrite")

    with replacing(str(out), kind="hf_export", key="--output", overwrite=True) as folder:
        _write(folder, **{"config.json": "{}", "model.safetensors": "new"})
    assert _tree(out) == {"config.json": b"{}", "model.safetensors": b"new", MARKER: (out / MARKER).read_bytes()}
    assert sorted(p.name for p in out.parent.iterdir()) == ["m"]  # neither the temporary nor the old folder is left

    empty = world / "empty"
    empty.mkdir()
    with replacing(str(empty), kind="sweep", key="sweep.out_dir", overwrite=False) as folder:
        _write(folder, **{"sweep.csv": "M\n"})
    assert (empty / "sweep.csv").read_text() == "M\n"


def test_a_failing_writer_leaves_the_earlier_output_as_it_was(world):
    out = world / "export"
    with replacing(str(out), kind="hf_export", key="--output") as folder:
        _write(folder, **{"model.safetensors": "good"})
    before = _tree(out)
    with pytest.raises(OSError, match="disk full"), replacing(str(out), kind="hf_export", key="--output") as folder:
        _write(folder, **{"model.safetensors": "half"})
        raise OSError("disk full")
    assert _tree(out) == before
    assert sorted(p.name for p in world.iterdir()) == ["checkpoints", "configs", "export", "here"]


def test_the_write_probe(tmp_path):
    a_file = tmp_path / "file.txt"
    a_file.write_text("x")
    _refusal(
        lambda: check_writable("/proc/qkvflow-test/checkpoints", "trainer.checkpointer.base_path"),
        "trainer.checkpointer.base_path='/proc/qkvflow-test/checkpoints' cannot be written",
        "/proc",
    )
    _refusal(lambda: check_writable(str(a_file), "trainer.log_dir"), f"trainer.log_dir={str(a_file)!r} is a file")
    _refusal(
        lambda: check_writable(str(a_file / "runs"), "trainer.tracker.path"), f"is inside {a_file}, which is a file"
    )
    check_writable(str(tmp_path / "new" / "deeper"), "key")  # absent: probed in the nearest existing folder
    check_writable("gs://bucket/checkpoints", "key")  # remote: left to fsspec
    check_writable(None, "key")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file.txt"]  # nothing created, no probe left
