"""The task pool of `qkvflow bench compare --jobs K`: at most K runs at once, each waiting on its own process.

A study's runs are subprocesses (`qkvflow train`, `qkvflow eval`); a thread per task waits on one, and at
most `jobs` tasks run at once. A waiting task of lower priority starts first, ties in the order submitted,
so that a model's test evaluations (and the runs that settle its choice) go ahead of the trainings queued
for later models, and results come model by model.
"""

import heapq
import itertools
import threading
from concurrent.futures import Future


class Pool:
    """Runs tasks on threads of their own (each waits on a subprocess), at most `jobs` at once; a waiting task
    of lower `priority` starts first, ties in the order submitted: a model's test evaluations (0) go before
    the trainings still queued for later models (1), so results come model by model."""

    def __init__(self, jobs: int):
        self._ready = threading.Condition()
        self._free, self._waiting, self._order, self._closed = jobs, [], itertools.count(), False
        self._threads: list[threading.Thread] = []

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
        try:
            future.set_result(fn(*args))
        except BaseException as e:  # noqa: BLE001 (a Ctrl-C in a run reaches the main thread through .result())
            future.set_exception(e)
        finally:
            with self._ready:
                self._free += 1
                self._ready.notify_all()

    def shutdown(self) -> None:
        """Drop the tasks not started; wait for the running ones (a Ctrl-C has reached their processes too)."""
        with self._ready:
            self._closed = True
            self._ready.notify_all()
        for thread in self._threads:
            thread.join()
