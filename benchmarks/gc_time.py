"""The time a Python program spends in the cyclic garbage collector, at chosen thresholds.

    python benchmarks/gc_time.py [--thresholds 700,10,10] -m qkvflow train --config_path CFG ...
    python benchmarks/gc_time.py --thresholds 700,10,10 -m pytest -q -p no:cacheprovider tests/integrate

Runs the module after `-m` in this process, as `python -m` would, and at exit prints to stderr one
line: the seconds spent collecting (`gc.callbacks`, from each collection's start to its stop) and the
collections per generation. Without `--thresholds` the program keeps its own: a `qkvflow` verb, and the
test suite's conftest, set `qkvflow.cli.GC_THRESHOLDS` when they start (`qkvflow.cli.collect_less`).
`--thresholds` sets these instead, for the whole run, so that Python's defaults (700,10,10) can be timed
against qkvflow's.
"""

import argparse
import atexit
import gc
import runpy
import sys
import time


class CollectorClock:
    """Seconds in collections and collections per generation, from `gc.callbacks`."""

    def __init__(self):
        self.seconds, self.collections, self._start = 0.0, [0, 0, 0], None

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        elif self._start is not None:
            self.seconds += time.perf_counter() - self._start
            self.collections[info["generation"]] += 1
            self._start = None

    def line(self) -> str:
        return f"gc: {self.seconds:.2f} s collecting, collections per generation {self.collections}"


def parse_thresholds(text: str) -> tuple[int, ...]:
    values = tuple(int(v) for v in text.split(","))
    if len(values) != 3 or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected three positive integers, e.g. 700,10,10")
    return values


def main(argv: list[str]) -> None:
    if "-m" not in argv:
        sys.exit("usage: gc_time.py [--thresholds A,B,C] -m MODULE [ARGS ...]")
    split = argv.index("-m")
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--thresholds", type=parse_thresholds, default=None)
    args = p.parse_args(argv[:split])
    if split + 1 >= len(argv):
        sys.exit("gc_time.py: -m needs a module")
    module, rest = argv[split + 1], argv[split + 2 :]
    clock = CollectorClock()
    gc.callbacks.append(clock)
    atexit.register(lambda: print(clock.line(), file=sys.stderr, flush=True))
    if args.thresholds is not None:
        import qkvflow.cli

        gc.set_threshold(*args.thresholds)
        qkvflow.cli.GC_THRESHOLDS = args.thresholds  # what collect_less sets when the program starts
    sys.argv = [module, *rest]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(sys.argv[1:])
