"""How a verb's path runs through qkvflow's rooms: the calls one command makes, read in order.

    python benchmarks/verb_path.py -- eval --config_path configs/quickstart.yaml --checkpoint checkpoints/quickstart --steps 4

Runs `qkvflow ARGS...` in this process under `sys.setprofile` and records every call of a qkvflow function
(the caller and callee modules). A *room* is a top-level package or module of `qkvflow` (`runs`,
`training`, `errors`, ...), placed in the layers of docs/architecture.md (`tests/test_layout.py`'s
`LAYERS`; a room that no longer exists, such as an old checkout's, counts at the layer its code had). It
prints one JSON object on stderr (stdout is the verb's):

- `rooms`: distinct rooms the path enters; `stays`: maximal runs of consecutive calls in one room;
- `returns`: stays in a room the path had already left;
- `climbs`: calls from a qkvflow function to one in a higher layer (a lower room calling up), with the
  distinct (caller room, callee room) pairs.

The numbers describe the code's shape, not its speed; `PYTHONPATH` picks the checkout measured.
"""

import importlib.util
import json
import sys
from collections import Counter
from pathlib import Path

# the layer table the suite enforces, read from this checkout's test file without putting this checkout
# on sys.path (PYTHONPATH chooses the qkvflow measured)
_spec = importlib.util.spec_from_file_location(
    "_layout", Path(__file__).resolve().parents[1] / "tests" / "test_layout.py"
)
_layout = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_layout)
LAYERS = _layout.LAYERS

OLD_ROOMS = {"configfile": 3}  # modules of older checkouts that have moved since: the layer of their code


def room(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def layer(r: str) -> int:
    return LAYERS.get(r, OLD_ROOMS.get(r, -1))


def trace(argv: list[str]) -> dict:
    calls: list[tuple[str, str]] = []

    def profile(frame, event, arg):
        if event != "call" or frame.f_code.co_name == "<module>":  # a module's import is not a call
            return
        callee = frame.f_globals.get("__name__", "")
        if not callee.startswith("qkvflow"):
            return
        back = frame.f_back
        caller = back.f_globals.get("__name__", "") if back is not None else ""
        calls.append((caller, callee))

    from qkvflow.cli import main

    sys.setprofile(profile)
    try:
        status = main(argv)
    except SystemExit as e:
        status = e.code
    finally:
        sys.setprofile(None)
    sequence = [room(callee) for _, callee in calls]
    stays = [r for i, r in enumerate(sequence) if i == 0 or sequence[i - 1] != r]
    seen, returns = set(), 0
    for r in stays:
        returns += r in seen
        seen.add(r)
    climbs = Counter(
        (room(a), room(b)) for a, b in calls if a.startswith("qkvflow") and layer(room(b)) > layer(room(a))
    )
    return {
        "argv": argv,
        "status": status,
        "calls": len(calls),
        "rooms": len(seen),
        "stays": len(stays),
        "returns": returns,
        "climbs": sum(climbs.values()),
        "climb_pairs": sorted(f"{a} -> {b}" for a, b in climbs),
        "unplaced_rooms": sorted(r for r in seen if layer(r) < 0),
    }


if __name__ == "__main__":
    args = sys.argv[1:]
    if args[:1] == ["--"]:
        args = args[1:]
    if not args or args[0] in ("-h", "--help"):
        print(__doc__)
        sys.exit(0)
    result = trace(args)
    print(json.dumps(result), file=sys.stderr)  # stdout is the verb's own
