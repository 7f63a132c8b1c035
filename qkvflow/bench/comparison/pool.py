"""The task pool of `qkvflow bench compare --jobs K`: at most K runs at once, each waiting on its own process.

A study's runs are subprocesses (`qkvflow train`, `qkvflow eval`); a thread per task waits on one, and at
most `jobs` tasks run at once. A waiting task of lower priority starts first, ties in the order submitted,
so that a model's test evaluations (and the runs that settle its choice) go ahead of the trainings queued
for later models, and results come model by model.

Stopping (Ctrl-C, SIGTERM, a hang-up): each run's process has a process group of its own (`run`), so a
terminal's Ctrl-C reaches the study alone, and `stop` passes one signal on to each running process, once:
a training stops after its step with a checkpoint, or at once before its first step (qkvflow.training.faults).
`stop` closes the pool first, under the lock every start takes, so no queued run starts after it, not even
in a slot a stopped run frees. A second Ctrl-C passes a second signal on (the runs end at once, unsaved).
"""

import contextlib
import heapq
import itertools
import signal
import subprocess
import threading
from concurrent.futures import Future


class Stopped(Exception):
    """A run that was not started because the pool had been stopped."""


class Interrupted(Exception):
    """SIGTERM or SIGHUP reached the study (`raising_on`); Ctrl-C is Python's KeyboardInterrupt."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


_task = threading.local()  # the pool whose task runs on this thread (`current`)


def current_pool() -> "Pool | None":
    """The pool running the calling thread's task, or None outside a task."""
    return getattr(_task, "pool", None)


class Pool:
    """Runs tasks on threads of their own (each waits on a subprocess), at most `jobs` at once; a waiting task
    of lower `priority` starts first, ties in the order submitted: a model's test evaluations (0) go before
    the trainings still queued for later models (1), so results come model by model."""

    def __init__(self, jobs: int):
        self._ready = threading.Condition()
        self._free, self._waiting, self._order, self._closed = jobs, [], itertools.count(), False
        self._threads: list[threading.Thread] = []
        self._running: dict[str, subprocess.Popen] = {}  # run name -> its process, while it runs

    def submit(self, priority: int, fn, *args) -> Future:
        future, ticket = Future(), (priority, next(self._order))
        with self._ready:
            heapq.heappush(self._waiting, ticket)
        thread = threading.Thread(target=self._run, args=(ticket, future, fn, args), daemon=True)
        self._threads.append(thread)
        thread.start()
        return future

    def _run(self, ticket, future: Future, fn, args) -> None:
        with self._ready:
            self._ready.wait_for(lambda: self._closed or (self._free > 0 and self._waiting[0] == ticket))
            if self._closed or not future.set_running_or_notify_cancel():
                future.cancel()
                return
            heapq.heappop(self._waiting)
            self._free -= 1
            self._ready.notify_all()
        _task.pool = self
        try:
            future.set_result(fn(*args))
        except BaseException as e:  # noqa: BLE001 (a Ctrl-C in a run reaches the main thread through .result())
            future.set_exception(e)
        finally:
            _task.pool = None
            with self._ready:
                if isinstance(future.exception(), KeyboardInterrupt):
                    self._closed = True  # an interrupted task: start nothing more
                self._free += 1
                self._ready.notify_all()

    def run(self, name: str, cmd: list[str], timeout: float | None = None, popen=subprocess.Popen, **kwargs) -> int:
        """`cmd` as the process of the run `name` (`popen(cmd, **kwargs)`), in a process group of its own and
        with no terminal input; its exit status. Raises `Stopped` (starting nothing) once the pool is
        stopped, and subprocess.TimeoutExpired (the process killed) after `timeout` seconds."""
        # under the lock `stop` takes: a process starts before a stop (and is signalled by it) or not at all
        with self._ready:
            if self._closed:
                raise Stopped(name)
            proc = popen(cmd, process_group=0, stdin=subprocess.DEVNULL, **kwargs)
            self._running[name] = proc
        try:
            return proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise
        finally:
            with self._ready:
                self._running.pop(name, None)

    def stop(self, signum: int = signal.SIGINT) -> list[str]:
        """Start nothing more, and send `signum` once to each running process; the names of those runs, sorted."""
        with self._ready:
            self._closed = True
            self._ready.notify_all()
            for proc in self._running.values():
                with contextlib.suppress(ProcessLookupError):  # it has just ended
                    proc.send_signal(signum)
            return sorted(self._running)

    def waiting(self) -> int:
        """Tasks submitted and not started."""
        with self._ready:
            return len(self._waiting)

    def shutdown(self) -> None:
        """Drop the tasks not started; wait for the running ones (a Ctrl-C has reached their processes too)."""
        with self._ready:
            self._closed = True
            self._ready.notify_all()
        for thread in self._threads:
            thread.join()

    def stop_and_wait(self, signum: int = signal.SIGINT) -> list[str]:
        """`stop`, then wait for the running runs to end; a Ctrl-C while waiting passes a second signal on
        (the runs end at once, unsaved). The names of the runs the first signal stopped."""
        stopped = self.stop(signum)
        while True:
            try:
                self.shutdown()
                return stopped
            except KeyboardInterrupt:
                self.stop(signum)


@contextlib.contextmanager
def raising_on(signals=(signal.SIGTERM, signal.SIGHUP)):
    """Within the block, `signals` raise `Interrupted` in the main thread (as Ctrl-C raises
    KeyboardInterrupt), so that a study stops its runs (`Pool.stop_and_wait`) instead of leaving them
    running in their own process groups. Outside the main thread nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        raise Interrupted(signum)

    previous = {s: signal.signal(s, handler) for s in signals}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def stop_report(signal_name: str, stopped: list[str], waiting: int) -> str:
    """One line: what a stop by `signal_name` stopped (`stopped`: "VERB RUN" names) and left unstarted, and
    how to go on."""
    what = (
        f"stopped {len(stopped)} run{'s' * (len(stopped) != 1)} in progress ({', '.join(stopped)})"
        if stopped
        else "no run was in progress"
    )
    return (
        f"bench compare: {signal_name} received: {what}; {waiting} waiting did not start. Run the same command to "
        "resume: finished runs are read back, and a stopped training resumes from its last checkpoint"
    )
