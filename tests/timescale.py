"""One factor for every wall-clock limit of the test suite: `QKVFLOW_TEST_TIME_SCALE`.

A limit in a test (a subprocess's `timeout=`, a wait for a line, a thread's join, pytest-timeout's
per-test limit) is there to turn a hang into a failure, never to measure speed (speed targets live in
benchmarks/). Each is written as `limit(seconds)`: the seconds an idle 2-core machine needs with a wide
margin, times this factor. On a loaded or slow machine set the factor, e.g.

    QKVFLOW_TEST_TIME_SCALE=4 python -m pytest -n 2 ...

The default is 1. tests/test_suite_setup.py fails on a limit written as a bare number.
"""

import os

ENV = "QKVFLOW_TEST_TIME_SCALE"

PER_TEST = 1800.0
"""pytest-timeout's limit for one test (its fixtures included), in seconds at factor 1: longer than any
one test's subprocess limits, so that these, with their better messages, fire first."""


def factor(environ=os.environ) -> float:
    """The factor `QKVFLOW_TEST_TIME_SCALE` sets (1 when unset); a ValueError naming it for anything but a
    positive number."""
    text = environ.get(ENV, "").strip()
    if not text:
        return 1.0
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise ValueError(f"{ENV}={text!r} is invalid: expected a positive number (e.g. 4 on a loaded machine)")
    return value


SCALE = factor()


def limit(seconds: float) -> float:
    """`seconds` (what an idle machine needs, with a margin) times the suite's factor."""
    return seconds * SCALE
