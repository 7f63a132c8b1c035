"""Preemption and Ctrl-C: what `qkvflow train` and `qkvflow finetune` do on SIGTERM and SIGINT
(qkvflow.training.faults re-exports `Preemption`).

The first SIGTERM or SIGINT (Ctrl-C) asks the run to stop after the step in progress; `qkvflow train` then saves a checkpoint, waits for the write and exits
0 after SIGTERM (a preemption is not a failure) or 130 after SIGINT (128 + SIGINT, as a shell reports
Ctrl-C, so that `qkvflow train && next` stops). A second signal of the same kind ends the process at
once. With several processes (`jax.distributed`), JAX's preemption notifier receives the SIGTERM
instead, and all processes stop after the same step (a notice to any one of them stops all of
them); a SIGINT is passed on to that notifier as a SIGTERM, so Ctrl-C stops them alike.
Before the first step (loading, compiling) there is nothing to finish: one process stops at once,
with one line, exiting as it would after the step (`Preemption.exit_at_once_until_first_step`). A
compile holds the main thread in XLA, where Python runs no signal handler, so a watcher thread acts on
the signal (Python's wakeup fd), and likewise ends the process at a second signal whatever the main
thread is doing.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from typing import Iterable, Iterator, Optional

import jax


class Preemption:
    """SIGTERM and SIGINT handling: the first signal requests a stop after the current step; a second
    one of the same kind ends the process at once (its default action: Ctrl-C twice quits).

    Between `exit_at_once_until_first_step()` and `first_step_done()` (one process only) the first
    signal ends the process at once instead, with one line and the exit status a stop would have:
    130 after SIGINT, 0 after SIGTERM (`EXIT_STATUS`). A watcher thread reads the signal numbers
    Python's C-level handler writes to its wakeup fd, so both that exit and the second signal's work
    while the main thread is inside XLA (a compile, a step), where the Python handler would wait for
    it to return."""

    EXIT_STATUS = {signal.SIGINT: 128 + signal.SIGINT, signal.SIGTERM: 0}

    def __init__(self, signals: tuple[int, ...] = (signal.SIGTERM, signal.SIGINT), verb: str = "qkvflow train"):
        self.signals = signals
        self.verb = verb
        self.requested = False
        self.signal_name: Optional[str] = None
        self._previous: dict[int, object] = {}
        self._forwarded = False
        self._at_once = False  # before the first step: a signal ends the process
        self._seen: dict[int, int] = {}  # signals the watcher saw, by number
        self._exit_lock = threading.Lock()
        self._watcher: Optional[tuple[int, int, object, threading.Thread]] = None

    def install(self) -> "Preemption":
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._handle)
        self._watch()
        return self

    def restore(self) -> None:
        self._unwatch()
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def __enter__(self):
        return self.install()

    def __exit__(self, *exc):
        self.restore()

    def exit_at_once_until_first_step(self) -> None:
        """From now until `first_step_done`, a signal ends the process at once (nothing to save yet);
        one requested earlier (while the data was prepared) ends it now. With several processes
        (`jax.distributed`) nothing changes: they must agree on the step they stop after."""
        if _distributed_client() is not None:
            return
        self._at_once = True
        if self.requested:
            self._exit_now(self.signal_name)

    def first_step_done(self) -> None:
        """A step is done: from now on the first signal stops after the current step, with a checkpoint."""
        self._at_once = False

    def _exit_now(self, name: str) -> None:
        """One line, then the end of the process with `EXIT_STATUS` (from any thread: `os._exit`, as the
        main thread may be inside XLA; the run lock is the kernel's and goes with the process)."""
        with self._exit_lock:
            message = f"{self.verb}: stopped by {name} before the first step; nothing to save\n"
            for stream in (sys.stdout, sys.stderr):
                try:
                    stream.flush()
                except Exception:  # noqa: BLE001 (a stream in use by the other thread: its lines may be lost)
                    pass
            os.write(2, message.encode())
            os._exit(self.EXIT_STATUS.get(signal.Signals[name], 1))

    def _watch(self) -> None:
        """Start the watcher thread on a wakeup fd (main thread only, as `signal.set_wakeup_fd` requires)."""
        if threading.current_thread() is not threading.main_thread():
            return
        read, write = os.pipe()
        os.set_blocking(write, False)
        previous = signal.set_wakeup_fd(write, warn_on_full_buffer=False)
        thread = threading.Thread(target=self._watcher_loop, args=(read,), name="qkvflow-signals", daemon=True)
        self._watcher = (read, write, previous, thread)
        thread.start()

    def _unwatch(self) -> None:
        if self._watcher is None:
            return
        read, write, previous, thread = self._watcher
        self._watcher = None
        signal.set_wakeup_fd(previous)
        os.write(write, b"\0")  # no signal has number 0: it tells the watcher to end
        thread.join()
        os.close(read)
        os.close(write)

    def _watcher_loop(self, read: int) -> None:
        while True:
            for signum in os.read(read, 64):
                if signum == 0:
                    return
                if signum not in self.signals or _distributed_client() is not None:
                    continue  # another handler's signal; or several processes: the main thread decides
                self._seen[signum] = self._seen.get(signum, 0) + 1
                if self._at_once:
                    self._exit_now(signal.Signals(signum).name)
                elif self._seen[signum] >= 2:  # a second signal of this kind: at once, without saving
                    os._exit(128 + signum)

    def _handle(self, signum, frame):
        name = signal.Signals(signum).name
        if signum == signal.SIGTERM and self._forwarded:  # our own SIGTERM for JAX's notifier: not a second signal
            self._forwarded = False
            return
        if self._at_once:
            self._exit_now(name)
        if self.requested:  # second signal: stop waiting for the step and the checkpoint
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        self.requested, self.signal_name = True, name
        again = "press Ctrl-C again" if signum == signal.SIGINT else f"send {name} again"
        print(
            f"{self.verb}: {name} received: finishing the current step, saving a checkpoint, then exiting "
            f"({again} to exit at once, without saving)",
            file=sys.stderr,
            flush=True,
        )
        if signum != signal.SIGTERM and _distributed_client() is not None and jax.process_count() > 1:
            # all processes must stop after the same step: JAX's preemption notifier (which owns
            # SIGTERM under jax.distributed) makes them agree on it
            self._forwarded = True
            os.kill(os.getpid(), signal.SIGTERM)

    def should_stop(self, step: int) -> bool:
        """Whether to stop before training step `step` (0-based), on every process alike.

        One process: whether SIGTERM arrived. With `jax.distributed` (several processes, or a cluster
        JAX recognises), JAX's own preemption notifier owns SIGTERM: any process's notice makes all of
        them agree, in the background, on the same step to stop at (`reached_preemption_sync_point`),
        without a collective per step. Must then be called at every step by every process."""
        if _distributed_client() is not None:
            from jax.experimental import multihost_utils

            if multihost_utils.reached_preemption_sync_point(step):
                if not self.requested:
                    self.requested, self.signal_name = True, "SIGTERM (a preemption notice to one of the processes)"
                return True
            return self.requested and jax.process_count() == 1
        return self.requested

    def wrap(self, loader: Iterable, start: int = 0) -> Iterator:
        """The batches of `loader` (the first one for step `start`) until a stop is requested."""
        iterator = iter(loader)
        step = start
        while not self.should_stop(step):
            try:
                batch = next(iterator)
            except StopIteration:
                return
            yield batch
            step += 1


def _distributed_client():
    from jax._src import distributed  # what jax.experimental.multihost_utils itself consults

    return distributed.global_state.client
