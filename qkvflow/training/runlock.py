"""One process per run: an advisory lock on `<checkpointer base_path>/<run_id>/.qkvflow.lock`.

Two processes started with the same `trainer.id` would both write the same checkpoint folders and
the same metrics.jsonl (and the second would remove the first's checkpoint writes in progress as
"incomplete"). `qkvflow train` and `qkvflow finetune` therefore take this lock before any of that,
and refuse to start, in one line naming the holder, when another process holds it.

* The lock is `fcntl.flock` on the file, so the kernel releases it when its process ends in any
  way (SIGKILL included): a file left by a dead process is stale by construction and is simply
  taken over. The file holds JSON {host, pid, started} of the holder, for the message only; a run
  that ends removes it.
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

logger = logging.getLogger("qkvflow.training.runlock")

LOCK_FILE = ".qkvflow.lock"


class RunLock:
    """The lock of the run folder `run_path`; `acquire()` raises UserError when another process holds it."""

    def __init__(self, run_path: str):
        self.run_path = str(run_path)
        self.path = os.path.join(self.run_path, LOCK_FILE)
        self._fd: Optional[int] = None

    def acquire(self) -> "RunLock":
        import fcntl

        if "://" in self.run_path and not self.run_path.startswith("file://"):
            logger.info(f"{self.run_path} is remote: no run lock (two runs with this id would share its folders)")
            return self
        if self.run_path.startswith("file://"):
            self.path = os.path.join(self.run_path[len("file://") :], LOCK_FILE)
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _describe(fd)
                os.close(fd)
                raise UserError(
                    f"run folder {self.run_path} is in use by {holder} (lock file {self.path}): "
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

    def __enter__(self) -> "RunLock":
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
