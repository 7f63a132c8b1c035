"""Ctrl-C on the command line: one line on stderr and exit status 130, never a traceback.

130 is 128 + SIGINT, what a shell reports for a command that Ctrl-C stopped, so `qkvflow ... && next`
does not go on. Two ways, by what the verb's work is:

* Most verbs: Python turns SIGINT into KeyboardInterrupt, which unwinds the verb (its `with` blocks
  remove their temporary folders and release their locks), and `qkvflow.cli.main` prints `line(verb)`
  and returns `STATUS`. `train` and `finetune` install their own handler once the run starts
  (qkvflow.training.faults.Preemption: finish the step, save, exit 130); this only covers the time
  before, and what their handler passes on.
* `AT_ONCE` verbs (`plan`, `describe`) write nothing until their work is done, and spend it in XLA's
  compiler or tracing, C++ that does not return to Python for minutes: a KeyboardInterrupt would wait
  for the compile to end. `at_once` ends such a process as soon as SIGINT arrives: the C-level signal
  handler writes the signal number to a pipe (`signal.set_wakeup_fd`), and a thread waiting on it prints
  the line and exits with `os._exit` (XLA's compiler releases the GIL, so the thread runs meanwhile).
"""

import contextlib
import os
import signal
import threading

STATUS = 128 + signal.SIGINT
AT_ONCE = ("plan", "describe")
"""Verbs that write nothing before their work ends: Ctrl-C ends them at once (`at_once`)."""


def line(verb: str) -> str:
    return f"qkvflow {verb}: interrupted (Ctrl-C)"


@contextlib.contextmanager
def at_once(verb: str):
    """Within the block, SIGINT ends the process at once with `line(verb)` and `STATUS`. Only from the
    main thread (where signal handlers live); elsewhere the block runs unchanged."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    read, write = os.pipe()
    os.set_blocking(write, False)
    done = threading.Event()

    def watch():
        while True:
            byte = os.read(read, 1)
            if done.is_set() or not byte:
                return
            if byte[0] == signal.SIGINT:
                os.write(2, (line(verb) + "\n").encode())
                os._exit(STATUS)

    handler = signal.signal(signal.SIGINT, lambda signum, frame: None)  # the thread acts, not the main thread
    wakeup = signal.set_wakeup_fd(write, warn_on_full_buffer=False)
    watcher = threading.Thread(target=watch, name="qkvflow-ctrl-c", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        done.set()
        signal.set_wakeup_fd(wakeup)
        signal.signal(signal.SIGINT, handler)
        os.write(write, b"\0")
        watcher.join()
        os.close(read)
        os.close(write)
