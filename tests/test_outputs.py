"""qkvflow.outputs: the write probe, the safe replacement of output folders and files, and the repository's
tracked folders, in-process.

Every refusal must be one line naming the key and the path, and leave every file where it was.
"""

import json
import os
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

from qkvflow import outputs
from qkvflow.errors import UserError
from qkvflow.outputs import (
    MARKER,
    check_file,
    check_replaceable,
    check_writable,
    replacing,
    write_file,
    writing_file,
)


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


def test_a_folder_that_becomes_yours_during_the_write_is_not_replaced(world):
    """`check_replaceable` runs again just before the swap: a file of the user's put into the target while
    the writer ran (the target absent, then an earlier output, at the first check) survives, and so does
    the folder; the new output is dropped and no temporary folder is left."""
    for earlier in (False, True):
        out = world / f"export-{earlier}"
        if earlier:
            with replacing(str(out), kind="hf_export", key="--output") as folder:
                _write(folder, **{"model.safetensors": "old"})
        with pytest.raises(UserError, match="did not write|was not written by qkvflow"):
            with replacing(str(out), kind="hf_export", key="--output") as folder:
                _write(folder, **{"model.safetensors": "new"})
                out.mkdir(exist_ok=True)
                (out / "thesis.tex").write_text("years of work")
        assert (out / "thesis.tex").read_text() == "years of work"
        assert (out / "model.safetensors").exists() == earlier
    assert sorted(p.name for p in world.iterdir()) == ["checkpoints", "configs", "export-False", "export-True", "here"]


def _read_only(folder: Path):
    """Make `folder` refuse new entries: `chattr +i` as root (whom modes do not stop), mode 555 otherwise.
    Returns the undo, or None when this file system or user cannot do it."""
    import subprocess

    if os.geteuid() == 0:
        done = subprocess.run(["chattr", "+i", str(folder)], capture_output=True).returncode == 0
        return (lambda: subprocess.run(["chattr", "-i", str(folder)], check=True)) if done else None
    folder.chmod(0o555)
    return lambda: folder.chmod(0o755)


def test_the_write_probe_beside_an_output_checks_its_parent(tmp_path):
    """`beside=True` probes where `replacing` puts its temporary sibling: an existing, writable output
    folder inside a read-only parent is refused at the start (not after the work, at the swap)."""
    parent = tmp_path / "parent"
    out = parent / "export"
    out.mkdir(parents=True)
    check_writable(str(out), "--output", beside=True)
    undo = _read_only(parent)
    if undo is None:
        pytest.skip("cannot make a read-only folder here (chattr +i failed as root)")
    try:
        check_writable(str(out), "--output")  # the folder itself can still be written ...
        _refusal(  # ... but not beside it
            lambda: check_writable(str(out), "--output", beside=True),
            f"--output={str(out)!r} cannot be written (creating a file in {parent} failed",
        )
    finally:
        undo()
    assert sorted(p.name for p in parent.iterdir()) == ["export"] and not any(out.iterdir())


def test_nothing_is_written_inside_a_run_folder(world, tmp_path):
    """Issue 56, item 4: `outside` keeps an output out of a checkpoint's run folder and its step-N
    folders (Levanter's), for a folder output and a file output alike; beside the run folder is fine."""
    run = world / "checkpoints" / "run"
    outside = [("the run folder of --checkpoint", str(run))]
    before = _tree(tmp_path)
    for path in (run / "step-2" / "exp", run / "exp", run / "step-2" / "deep" / "er"):
        _refusal(
            lambda p=path: check_replaceable(p, kind="hf_export", key="--output", outside=outside),
            f"--output={str(path)!r} is inside the run folder of --checkpoint {str(run)!r}",
        )
        with pytest.raises(UserError), replacing(path, kind="hf_export", key="--output", outside=outside):
            raise AssertionError("the writer must not run")
        _refusal(
            lambda p=path: check_file(p / "out.jsonl", "--output_jsonl", outside=outside),
            "is inside the run folder of --checkpoint",
        )
    assert _tree(tmp_path) == before and not (run / "exp").exists()
    check_replaceable(world / "checkpoints" / "exp", kind="hf_export", key="--output", outside=outside)
    check_file(world / "checkpoints" / "out.jsonl", "--output_jsonl", outside=outside)


def test_an_output_file_must_be_a_writable_file_path(world, tmp_path):
    """Issue 56, item 2: `check_file` refuses a folder, a file the verb reads, a path under a file and a
    remote URL, each in one line, and accepts a new file or an existing one of the user's to replace."""
    prompts = world / "prompts.txt"
    prompts.write_text("Once upon\n")
    protect = [("--prompts_file", str(prompts))]
    before = _tree(tmp_path)
    for path, reason in [
        (world / "here", "is a folder: expected the path of a file to write"),
        (prompts, "is --prompts_file: refusing to overwrite it"),
        (world / "here" / "notes.txt" / "out.jsonl", "which is a file: expected a folder that qkvflow can write to"),
        ("gs://bucket/out.jsonl", "is a remote URL: expected a local file"),
    ]:
        _refusal(
            lambda p=path: check_file(p, "--output_jsonl", protect=protect), f"--output_jsonl={str(path)!r}", reason
        )
    assert _tree(tmp_path) == before
    check_file(world / "here" / "out.jsonl", "--output_jsonl", protect=protect)
    check_file(world / "here" / "notes.txt", "--output_jsonl", overwrite=True, protect=protect)


def test_an_existing_file_is_replaced_only_with_overwrite(world):
    """Issue 62, item 1: an existing file (the user's notes) is refused in one line that names --overwrite, and
    the writer never runs; with overwrite the new bytes replace it, keeping its permission bits."""
    notes = world / "here" / "notes.txt"
    notes.chmod(0o640)
    for call in (
        lambda: check_file(notes, "--output_jsonl"),
        lambda: write_file(notes, "--output_jsonl", "new\n"),
    ):
        _refusal(call, f"--output_jsonl={str(notes)!r} exists: pass --overwrite to replace it")
    with pytest.raises(UserError), writing_file(notes, "--output_jsonl"):
        raise AssertionError("the writer must not run")
    assert notes.read_bytes() == b"mine" and os.listdir(notes.parent) == ["notes.txt"]
    write_file(notes, "--output_jsonl", "new\n", overwrite=True)
    assert notes.read_bytes() == b"new\n" and os.listdir(notes.parent) == ["notes.txt"]
    assert stat.S_IMODE(notes.stat().st_mode) == 0o640
    fresh = world / "here" / "deeper" / "out.jsonl"  # a new file in a new folder needs no --overwrite
    write_file(fresh, "--output_jsonl", b"\x00bytes")
    assert fresh.read_bytes() == b"\x00bytes" and os.listdir(fresh.parent) == ["out.jsonl"]


def test_the_new_file_is_renamed_into_place(world):
    """The old file is never opened for writing: a hard link to it (the same inode) still holds the old
    bytes after the replacement, which a write in place (open(path, "w")) would have truncated."""
    notes, link = world / "here" / "notes.txt", world / "link.txt"
    os.link(notes, link)
    with writing_file(notes, "--output_jsonl", overwrite=True) as tmp:
        assert os.path.dirname(tmp) == str(notes.parent) and tmp.endswith(".txt")  # same folder, same format
        Path(tmp).write_text("new")
        assert notes.read_text() == "mine"  # not yet: only when the block ends
    assert notes.read_text() == "new" and link.read_text() == "mine"


def test_a_failed_write_leaves_the_old_file_and_no_temporary_file(world, monkeypatch):
    """A writer that fails midway, and a rename that fails, leave the old file's bytes and nothing else."""
    notes = world / "here" / "notes.txt"
    with pytest.raises(RuntimeError, match="disk full"), writing_file(notes, "--output_jsonl", overwrite=True) as tmp:
        Path(tmp).write_text("half of the ne")
        raise RuntimeError("disk full")
    assert notes.read_bytes() == b"mine" and os.listdir(notes.parent) == ["notes.txt"]

    def fails(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(outputs.os, "replace", fails)
    with pytest.raises(OSError, match="No space left"):
        write_file(notes, "--output_jsonl", "new", overwrite=True)
    assert notes.read_bytes() == b"mine" and os.listdir(notes.parent) == ["notes.txt"]


def test_a_file_that_appears_during_the_write_is_not_replaced(world):
    """The rules are checked again before the rename: a file created meanwhile is refused without overwrite."""
    out = world / "here" / "out.jsonl"
    with pytest.raises(UserError, match="exists: pass --overwrite"), writing_file(out, "--output_jsonl") as tmp:
        Path(tmp).write_text("ours")
        out.write_text("theirs")
    assert out.read_text() == "theirs" and sorted(os.listdir(out.parent)) == ["notes.txt", "out.jsonl"]


def test_a_symbolic_link_is_not_an_output_file(world):
    link = world / "here" / "link.jsonl"
    link.symlink_to(world / "configs" / "run.yaml")
    _refusal(lambda: check_file(link, "--output_jsonl", overwrite=True), "is a symbolic link")
    assert (world / "configs" / "run.yaml").read_text() == "model: {}\n"


@pytest.fixture
def repo(tmp_path, monkeypatch):
    """A stand-in checkout (a broken check must not write into the real one) with every shipped folder and file."""
    root = tmp_path / "repo"
    for name in outputs.SHIPPED:
        (root / name).mkdir(parents=True)
    (root / "benchmarks" / "results").mkdir()
    (root / "benchmarks" / "results" / "quality.json").write_text("{}")
    for name in outputs.SHIPPED_FILES:
        (root / name).write_text(name)
    monkeypatch.setattr(outputs, "ROOT", root)
    return root


def test_no_output_goes_into_the_repositorys_tracked_folders_or_files(repo, monkeypatch):
    """Issue 62, items 1 and 5: a file or folder output inside a tracked folder (or that folder itself), or
    onto a tracked top-level file, is refused in one line, with --overwrite too, and nothing there changes.
    Relative paths are taken from the current folder; untracked folders of the checkout are fine."""
    monkeypatch.chdir(repo)
    before = _tree(repo)
    for path in ("configs/exp", "configs", "docs/notes.md", "benchmarks/results/quality.json", "qkvflow/x/y"):
        reason = f"is inside the repository's shipped folder {path.split('/')[0]}/"
        if path != "configs":  # a folder: check_file says so first
            _refusal(lambda p=path: check_file(p, "--output", overwrite=True), f"--output={path!r} {reason}")
        _refusal(lambda p=path: check_replaceable(p, kind="hf_export", key="--output"), reason)
        with pytest.raises(UserError, match="shipped folder"), replacing(path, kind="hf_export", key="--output"):
            raise AssertionError("the writer must not run")
    for name in outputs.SHIPPED_FILES:
        _refusal(lambda n=name: write_file(n, "--output_jsonl", "x", overwrite=True), f"tracked file {name}")
    assert _tree(repo) == before and not (repo / "configs" / "exp").exists()
    write_file("runs/out.jsonl", "--output_jsonl", "x")
    check_replaceable("exports/exp", kind="hf_export", key="--output")
    monkeypatch.setattr(outputs, "ROOT", repo / "site-packages")  # an installed qkvflow: no checkout to protect
    check_file(repo / "docs" / "x.md", "--output")


def test_the_tracked_lists_are_gits():
    """SHIPPED and SHIPPED_FILES are the repository's top level as git tracks it."""
    if not shutil.which("git") or not (outputs.ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    run = lambda *a: subprocess.run(["git", "-C", str(outputs.ROOT), *a], capture_output=True, text=True, check=True)  # noqa: E731
    folders = run("ls-tree", "-d", "--name-only", "HEAD").stdout.split()
    everything = run("ls-tree", "--name-only", "HEAD").stdout.split()
    assert sorted(outputs.SHIPPED) == sorted(folders)
    assert sorted(outputs.SHIPPED_FILES) == sorted(set(everything) - set(folders))


def test_the_rules_import_without_the_heavy_stack():
    """The CLI checks outputs before it imports JAX: qkvflow.outputs pulls in none of the heavy libraries."""
    import sys

    heavy = ("jax", "numpy", "levanter", "transformers", "equinox", "haliax")
    code = f"import sys, qkvflow.outputs; print([m for m in {heavy!r} if m in sys.modules])"
    found = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert found.strip() == "[]"


def test_a_run_file_is_replaced_whole_or_not_at_all(tmp_path, monkeypatch):
    """`replace_whole` (a run's record, its metrics rewrite): the new bytes renamed onto the old file (a hard
    link to the old one keeps the old bytes); a rename that fails leaves the old bytes and no temporary file."""
    path = tmp_path / "run" / "metrics.jsonl"
    path.parent.mkdir()
    path.write_bytes(b"old\n")
    os.link(path, tmp_path / "old")
    outputs.replace_whole(str(path), b"new\n")
    assert path.read_bytes() == b"new\n" and (tmp_path / "old").read_bytes() == b"old\n"

    def fails(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", fails)
    with pytest.raises(OSError, match="disk full"):
        outputs.replace_whole(str(path), b"newer\n")
    assert path.read_bytes() == b"new\n" and sorted(p.name for p in path.parent.iterdir()) == ["metrics.jsonl"]
