"""`qkvflow bench MODE ...`: dispatch to a benchmark of qkvflow.bench (speed, scaling, quality, compare, exits, depth)."""

import importlib

from qkvflow.errors import UserError

MODES = {
    "speed": "qkvflow.bench.performance.speed",
    "scaling": "qkvflow.bench.performance.scaling",
    "quality": "qkvflow.bench.quality",
    "compare": "qkvflow.bench.comparison.compare",
    "exits": "qkvflow.bench.exits",
    "depth": "qkvflow.bench.depth_merge",
}


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: qkvflow bench {" + "|".join(MODES) + "} [options]  (qkvflow bench MODE --help)")
        return 0
    mode, rest = argv[0], argv[1:]
    if mode not in MODES:
        raise UserError(f"unknown bench mode {mode!r}: expected one of {', '.join(MODES)}")
    return importlib.import_module(MODES[mode]).main(rest) or 0  # lazy: as the dispatcher imports a verb (qkvflow.cli)
