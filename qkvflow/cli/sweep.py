"""`qkvflow sweep`: fine-tune one pretrained ODE model at several depths M with several methods.

    qkvflow sweep --config_path configs/finetune/owt_to_wikitext103.yaml [--depths 9,12,18,24] [--methods lora,full]

This module parses the command line (`--depths`, `--methods` and a `qkvflow finetune` config); the grid,
its resumption and its outputs are `qkvflow.finetune.sweep`, whose docstring describes them.
"""

from qkvflow.cli.startup import usage
from qkvflow.cli.train import stop_status
from qkvflow.errors import UserError
from qkvflow.finetune.run import METHODS, FinetuneConfig
from qkvflow.finetune.sweep import sweep
from qkvflow.runs import configfile


def _split_grid_args(argv: list[str]) -> tuple[list[str], dict]:
    """Take `--depths 9,12` and `--methods lora,full` (also `--depths=...`) out of argv."""
    rest, grid = [], {}
    i = 0
    while i < len(argv):
        arg = argv[i]
        name = next((n for n in ("depths", "methods") if arg == f"--{n}" or arg.startswith(f"--{n}=")), None)
        if name is None:
            rest.append(arg)
            i += 1
            continue
        if "=" in arg:
            value = arg.split("=", 1)[1]
            i += 1
        else:
            if i + 1 >= len(argv):
                raise UserError(
                    f"--{name} needs a value, e.g. --{name} " + ("9,12,18,24" if name == "depths" else "lora,full")
                )
            value = argv[i + 1]
            i += 2
        grid[name] = [v.strip() for v in value.strip("[]").split(",") if v.strip()]
    return rest, grid


def parse_depths(values, key: str = "--depths") -> list[int]:
    depths = []
    for v in values:
        try:
            d = int(v)
        except (TypeError, ValueError):
            d = None
        if d is None or isinstance(v, bool) or d < 1 or (isinstance(v, float) and v != d):
            raise UserError(f"{key}={v!r} is invalid: expected integers >= 1 (numbers of layers M)")
        depths.append(d)
    if not depths:
        raise UserError(f"{key} is empty: expected at least one depth M")
    return depths


def parse_methods(values, key: str = "--methods") -> list[str]:
    methods = list(values)
    for m in methods:
        if m not in METHODS:
            raise UserError(f"{key}={m!r} is invalid: expected one of {', '.join(METHODS)}")
    if not methods:
        raise UserError(f"{key} is empty: expected at least one of {', '.join(METHODS)}")
    return methods


def main(argv: list[str]) -> int:
    if usage.HELP_ALL in argv:  # the config keys, as `qkvflow finetune --help-all`
        configfile.parse(FinetuneConfig, ["--help"], "sweep")
    if usage.wants_help(argv):
        extra = (
            ("--depths M1,M2,...", "the depths M of the grid (default: sweep.depths)"),
            ("--methods lora,full", "the fine-tuning methods of the grid (default: sweep.methods)"),
        )
        summary = (
            "Fine-tune one pretrained ODE model at several depths M with several methods (a grid of "
            "`qkvflow finetune` runs, resumable) and write sweep.{csv,md,png}."
        )
        print(usage.short_help("qkvflow sweep", FinetuneConfig, summary, hide=("model",), extra=extra))
        return 0
    rest, grid = _split_grid_args(argv)  # sweep's own options; the rest is the finetune config
    config = configfile.parse(FinetuneConfig, rest, "sweep", required="a `qkvflow finetune` config")
    depths = parse_depths(grid["depths"]) if "depths" in grid else parse_depths(config.sweep.depths, "sweep.depths")
    methods = (
        parse_methods(grid["methods"]) if "methods" in grid else parse_methods(config.sweep.methods, "sweep.methods")
    )
    result = sweep(config, depths, methods)
    print("\n== qkvflow sweep: " + ("done ==" if result["complete"] else "incomplete =="))
    with open(result["md"]) as f:
        print(f.read())
    for key in ("csv", "md", "png"):
        print(f"{key:>4}: {result[key]}")
    if result["complete"]:
        return 0
    return stop_status(result) or 1  # 130 when Ctrl-C stopped a cell
