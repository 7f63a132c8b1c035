"""The grammar of `--steps` (eval, generate, export): fixed solver grids, as integers or relative to the trained N.

`N/4,N/2,N,2N,4N`, `3, 2*N, 5` and `8` are grids; `steps_grammar` reads one without knowing N (what the
command line can check before anything is loaded, `qkvflow.cli.startup.early`), and `parse_steps` resolves it
against a trained N. Only the standard library: the CLI imports this before JAX.
"""

import re

from qkvflow.errors import UserError

GRIDS = "comma-separated integers >= 1 or multiples of the trained N (e.g. N/2,N,2N,4N)"
"""What `--steps` takes in `qkvflow eval` (and `--auto_grids` everywhere)."""
ONE_GRID = "one grid N': an integer >= 1 or a multiple of the trained N (e.g. 8, 2N or N/2), or auto"
"""What `qkvflow generate --steps` takes."""
ONE_DEPTH = "one number of layers M: an integer >= 1 or a multiple of the trained N (e.g. 8, 2N or N/2)"
"""What `qkvflow export --steps` takes."""

_RELATIVE = re.compile(r"(\d+)?\s*\*?\s*N(?:\s*/\s*(\d+))?")


def parse_list(text, key: str, kind, expected: str) -> list:
    """`2,4,8` -> [2, 4, 8]; a UserError naming `key` for anything else."""
    if text is None:
        return []
    items = [s.strip() for s in str(text).split(",")]
    try:
        values = [kind(s) for s in items]
    except ValueError:
        values = None
    if not items or values is None or any(s == "" for s in items):
        raise UserError(f"--{key} {text!r} is invalid: expected {expected}")
    return values


def steps_grammar(text, key: str = "steps", expected: str | None = None) -> list:
    """The items of a grid list, each an int N' >= 1 or (times, over, text) for `times x N / over` written as
    `text`;
    a UserError naming `key` for anything else."""
    expected = expected or GRIDS
    items = []
    for item in parse_list(text, key, str, expected):
        match = _RELATIVE.fullmatch(item)
        if match is not None:
            items.append((int(match.group(1) or 1), int(match.group(2) or 1), item))
        elif not re.fullmatch(r"[+-]?\d+", item):
            raise UserError(f"--{key} {text!r} is invalid: expected {expected}")
        elif int(item) < 1:
            raise UserError(f"--{key} {item} is invalid: expected integers >= 1 (fixed solver steps N)")
        else:
            items.append(int(item))
    return items


def parse_steps(text, trained: int, key: str = "steps", expected: str | None = None) -> list[int]:
    """`--steps` (or another option `key`): integers, or multiples of the trained N written relative to it:
    `N/4,N/2,N,2N,4N` with N = `trained` gives [N/4, N/2, N, 2N, 4N]; each must come out a whole number >= 1.
    `expected`: what a refusal says the option takes (default: eval's comma-separated grids)."""
    steps = []
    for item in steps_grammar(text, key, expected):
        if isinstance(item, int):
            steps.append(item)
            continue
        times, over, written = item
        if over == 0 or (times * trained) % over or times * trained < over:
            raise UserError(
                f"--{key} {written} is invalid with the trained N={trained}: {times} x {trained} / {over} is not a "
                "whole number of steps >= 1"
            )
        steps.append(times * trained // over)
    return steps
