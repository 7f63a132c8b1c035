"""qkvflow.runs.runlock: a local run folder is locked whichever way its path is written.

flock conflicts between two open file descriptions of one file even within one process, so a second
`RunLock` here stands for a second `qkvflow train` (tests/test_train.py runs two real processes)."""

import json
import os

import pytest

from qkvflow.errors import UserError
from qkvflow.runs.runlock import LOCK_FILE, RunLock, RunLocks


@pytest.mark.parametrize("first, second", [("file://", ""), ("", "file://"), ("file://", "file://")])
def test_a_file_url_is_a_local_folder_and_is_locked(tmp_path, first, second):
    """`file:///x/run` (as fsspec and Levanter's checkpointer take it) is the folder /x/run: the lock file
    is written there, and a second lock on the same folder, in either spelling, is refused in one line."""
    run = tmp_path / "checkpoints" / "tiny"
    holder = RunLock(f"{first}{run}").acquire()
    try:
        held = json.loads((run / LOCK_FILE).read_text())
        assert held["pid"] == os.getpid()
        with pytest.raises(UserError) as refused:
            RunLock(f"{second}{run}").acquire()
        message = str(refused.value)
        assert f"is in use by process {os.getpid()}" in message and "\n" not in message
    finally:
        holder.release()
    assert not (run / LOCK_FILE).exists()
    RunLock(f"{second}{run}").acquire().release()  # free again once released


def test_one_folder_named_both_ways_is_locked_once(tmp_path):
    """RunLocks takes the lock of a folder once even when one place names it as a file:// URL (e.g. the
    checkpoint base path) and another as a path (the tracker's): the run does not refuse itself."""
    run = tmp_path / "tiny"
    locks = RunLocks([RunLock(f"file://{run}"), RunLock(str(run))])
    assert len(locks.locks) == 1
    with locks:
        with pytest.raises(UserError):
            RunLock(str(run)).acquire()


def test_a_remote_path_takes_no_lock(tmp_path, monkeypatch):
    """gs:// and the like cannot be flocked: nothing is created, and a second run is not refused."""
    monkeypatch.chdir(tmp_path)
    RunLock("gs://bucket/checkpoints/tiny").acquire()
    RunLock("gs://bucket/checkpoints/tiny").acquire()
    assert list(tmp_path.iterdir()) == []
