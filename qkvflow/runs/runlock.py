"""One process per run: an advisory lock on every place a run writes to.

Two processes started with the same `trainer.id` would both write the same checkpoint folders, the
same metrics.jsonl and loss curve, and the same log file (and the second would remove the first's
checkpoint writes in progress as "incomplete"), even with different checkpoint base paths when they
share the tracker folder. `qkvflow train` and `qkvflow finetune` therefore lock, before any of that
(`RunLocks`), `<checkpointer base_path>/<run_id>/.qkvflow.lock`, `<jsonl tracker path>/<run_id>/.qkvflow.lock`
(metrics and plots) and `<log_dir>/<run_id>.log.lock`, and refuse to start, in one line naming the
holder, when another process holds any of them.

* The lock is `fcntl.flock` on the file, so the kernel releases it when its process ends in any
  way (SIGKILL included): a file left by a dead process is stale by construction and is simply
  taken over. The file holds JSON {host, pid, started} of the holder, for the message only; a run
  that ends removes it, and the folders the lock created if they are still empty.
* With several processes of one run (`jax.distributed`), process 0 alone takes it.
* flock works between processes of one machine (and on local file systems); on a remote base path
  (gs://, s3://) no lock is taken, with a log line saying so.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import socket
from typing import Optional

from qkvflow.errors import UserError

logger = logging.getLogger("qkvflow.runs.runlock")

LOCK_FILE = ".qkvflow.lock"


class RunLock:
    """The lock of the run folder `run_path` (the file `lock_file` in it; `what` names the locked thing in
    the refusal); `acquire()` raises UserError when another process holds it."""

    def __init__(self, run_path: str, lock_file: str = LOCK_FILE, what: Optional[str] = None):
        self.run_path = str(run_path)
        self.lock_file = lock_file
        local = self.run_path.removeprefix("file://")  # a file:// URL is the local folder it names
        self.path = os.path.join(local, lock_file)
        self.what = what or f"run folder {self.run_path}"
        self._fd: Optional[int] = None
        self._created: list[str] = []

    def acquire(self) -> "RunLock":
        import fcntl

        if "://" in self.path:
            logger.info(f"{self.run_path} is remote: no run lock (two runs with this id would share its folders)")
            return self
        self._created = []
        while True:
            self._make_folders()  # again on a retry: a holder that ended may have removed them
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _describe(fd)
                os.close(fd)
                raise UserError(
                    f"{self.what} is in use by {holder} (lock file {self.path}): "
                    "wait for that run to end, or give this one another trainer.id"
                ) from None
            except BaseException:
                os.close(fd)
                raise
            if _same_file(fd, self.path):
                break
            os.close(fd)  # its holder removed the file as we opened it: lock the current one
        holder = {"host": socket.gethostname(), "pid": os.getpid(), "started": _now()}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(holder) + "\n").encode(), 0)
        self._fd = fd
        return self

    def _make_folders(self) -> None:
        """Create the lock file's folder, remembering the folders created (removed again, deepest first,
        by `release` if the run leaves them empty)."""
        folder = os.path.dirname(self.path)
        while folder and not os.path.isdir(folder):
            if folder not in self._created:
                self._created.append(folder)
            folder = os.path.dirname(folder)
        self._created.sort(key=lambda f: f.count(os.sep), reverse=True)
        os.makedirs(os.path.dirname(self.path), exist_ok=True)

    def release(self) -> None:
        """Remove the file, then unlock (in this order, so that a process waiting on the old file
        notices that it is gone and locks a new one)."""
        if self._fd is not None:
            import fcntl

            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None
            for folder in self._created:  # those the run left empty (e.g. it was refused): not left behind
                try:
                    os.rmdir(folder)
                except OSError:
                    break

    def __enter__(self) -> "RunLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


class RunLocks:
    """Several `RunLock`s taken together (in the order given, the same folder once) and released together;
    when one is refused, those already taken are released before the UserError propagates."""

    def __init__(self, locks: list[RunLock]):
        seen, self.locks = set(), []
        for lock in locks:
            key = os.path.normpath(os.path.abspath(lock.path)) if "://" not in lock.path else lock.path
            if key not in seen:
                seen.add(key)
                self.locks.append(lock)
        self._held: list[RunLock] = []

    def acquire(self) -> "RunLocks":
        try:
            for lock in self.locks:
                self._held.append(lock.acquire())
        except BaseException:
            self.release()
            raise
        return self

    def release(self) -> None:
        while self._held:
            self._held.pop().release()

    def __enter__(self) -> "RunLocks":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def _same_file(fd: int, path: str) -> bool:
    try:
        return os.path.samestat(os.fstat(fd), os.stat(path))
    except FileNotFoundError:
        return False


def _describe(fd: int) -> str:
    try:
        holder = json.loads(os.pread(fd, 4096, 0) or b"{}")
        return f"process {holder['pid']} on host {holder['host']} (since {holder.get('started', '?')})"
    except (ValueError, KeyError, TypeError, OSError):
        return "another process"
