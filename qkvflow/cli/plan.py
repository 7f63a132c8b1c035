"""`qkvflow plan --config_path CFG --target NAME [--devices N] [--max_batch] [--json] [--key value ...]`:
compile the training step `qkvflow train` would run for CFG on N GPUs or TPU chips that are not here,
and say what each device needs (qkvflow.plan; docs/plan.md)."""

import argparse
import json

from qkvflow import outputs
from qkvflow.cli.startup import usage
from qkvflow.errors import UserError
from qkvflow.plan import backend, planner, report, search, targets
from qkvflow.plan.config import PlanConfig, vocabulary
from qkvflow.runs import configfile

USAGE = "qkvflow plan --config_path CFG --target NAME [--devices N] [--max_batch] [--json] [--dotted.key value ...]"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="qkvflow plan", usage=USAGE, description=__doc__, add_help=False, epilog=usage.footer("plan")
    )
    p.add_argument("--target", required=True, help=f"one of {', '.join(targets.known())}")
    p.add_argument("--devices", type=int, default=None, help="devices to compile for (default: 1; cpu:N's N)")
    p.add_argument("--max_batch", action="store_true", help="also find the largest per-device batch that fits")
    p.add_argument("--json", action="store_true", help="print the plan as one JSON object")
    p.add_argument("--device_memory", type=int, default=None, help="bytes of memory per device (default: the target's)")
    p.add_argument("--search", action="store_true", help="compile the layouts for --devices, rank those that fit")
    p.add_argument("--search_max_compiles", type=int, default=12, help="the search's compile cap (default 12)")
    p.add_argument("--search_model", default=None, help="model-axis sizes to try, e.g. 1,2 (default: every divisor)")
    p.add_argument("--search_fsdp", default="on,off", help="FSDP on, off or on,off (default)")
    p.add_argument(
        "--search_remat", default=None, help="remat values to try, e.g. null,5 (default: all the config allows)"
    )
    p.add_argument("--save_hlo", default=None, help="also write the compiled step's optimised HLO text to this file")
    p.add_argument("--overwrite", action="store_true", help=outputs.OVERWRITE_HELP)
    return p


def main(argv: list[str]) -> int:
    if "-h" in argv or "--help" in argv:
        print(parser().format_help())
        return 0
    args, rest = parser().parse_known_args(argv)
    target = targets.get(args.target, args.device_memory)
    n = targets.cpu_devices(target)
    if n is not None and args.devices not in (None, n):
        raise UserError(f"--devices {args.devices} contradicts --target {target.name}: give one of the two")
    devices = args.devices if args.devices is not None else n or 1  # (not `or`: --devices 0 is refused below)
    if devices < 1:
        raise UserError(f"--devices {devices} is invalid: expected an integer >= 1")
    if args.save_hlo:
        outputs.check_file(args.save_hlo, "--save_hlo", overwrite=args.overwrite)  # before compiling

    backend.start(devices)  # before anything runs on a backend
    config = configfile.parse(PlanConfig, rest, "plan", required="a training config")
    if args.search:
        out = search.search(config, target, devices, vocabulary(config), **search.options(args, config))
        print(json.dumps(out) if args.json else search.text(out, configfile.split_config_path(rest)[0]))
        return 0
    out = planner.plan(
        config,
        target,
        devices,
        vocabulary(config),
        search_max_batch=args.max_batch,
        hlo_file=args.save_hlo,
        overwrite=args.overwrite,
    )
    print(json.dumps(out) if args.json else report.text(out))
    return 0
