"""The command line's start-up seam: what `qkvflow VERB ...` answers or refuses before the verb's stack loads.

A verb's work needs JAX, Levanter, transformers and draccus, which take 5-15 s of CPU to import on a
2-core machine (`python -X importtime -m qkvflow ...`). A `--help` or a mistyped argument should not
wait for them: `check(verb, argv)` runs first, from `qkvflow.cli.main`, with the standard library,
PyYAML and light qkvflow modules only, and either answers (`--help`: True), refuses in one line
(`UserError`) or lets the verb go on (False). The verb checks everything again with its real parser;
passing here promises nothing more.

Checked here, for every verb:

* `--help` of each verb, `bench` mode and `analyze` analysis: printed from `table.json`, the text the
  verbs' own code renders (`qkvflow.cli.startup.table` writes it; a test pins it). `--help-all` is draccus's.
* an unknown `bench` mode or analysis, with the nearest known names (`did_you_mean`);
* the --config_path file: it exists, is UTF-8 YAML and a mapping (`qkvflow.runs.configfile.check_config_file`);
  no Levanter 1.2 keys in it or in the overrides (`qkvflow.runs.compat`); the overrides' own
  forms (`qkvflow.runs.configfile.overrides`);
* every `model.type` given (file or overrides) is registered (`table.json`'s `model_types`), and, for the
  verbs whose whole command line is their config, every top-level key is a field of it (`check_keys`);
* paths the verb reads exist (`PATHS`), and `--steps` is a grid (`qkvflow.evaluation.grids`);
* the files and folders it writes follow `qkvflow.outputs` as far as argv alone can say (`OUTPUT_FILES`,
  `OUTPUT_FOLDERS`): no existing file without --overwrite, nothing in the repository's tracked folders;
* `plan`: the target, the device count and the mesh (`plan_checks`).

This is the command line's start-up seam (the `qkvflow.cli` docstring): `qkvflow.cli` imports this module and other light ones at
its top, and the verb's module (which imports its stack at its top) and draccus only after `check`.
tests/test_cli_early.py checks that `--help` and every refusal here import none of JAX, Levanter,
transformers, torch, numpy or draccus.
"""

import difflib
import functools
import json
import os
import re
import sys
from pathlib import Path

import yaml

from qkvflow import outputs
from qkvflow.cli.startup.usage import HELP_ALL
from qkvflow.errors import UserError
from qkvflow.evaluation import grids
from qkvflow.plan import targets
from qkvflow.runs import configfile
from qkvflow.runs.compat import check_config

TABLE = Path(__file__).with_name("table.json")

SUBCOMMANDS = ("bench", "analyze")
"""Verbs whose first argument names a sub-command with a `--help` of its own."""

PATHS = {
    "eval": ("--checkpoint",),
    "generate": ("--checkpoint", "--prompts_file"),
    "export": ("--checkpoint",),
    "analyze": ("--checkpoint",),
    "tokenizer": ("--files",),
}
"""Per verb, the options whose values are files or folders it reads, which must exist."""

WHAT = {
    "--checkpoint": "checkpoints/<run_id> or one of its step-N folders",
    "--prompts_file": "a text file, one prompt per line",
    "--files": "a .txt or .jsonl file",
}

OUTPUT_FILES = {"generate": ("--output_jsonl",), "plan": ("--save_hlo",), "bench speed": ("--json_out",)}
"""Per command, the options naming a file it writes (`qkvflow.outputs.check_file`: not an existing file
without --overwrite, not in the repository's tracked folders)."""

OUTPUT_FOLDERS = {
    "eval": ("--output",),
    "export": ("--output",),
    "tokenizer": ("--output",),
    "analyze": ("--output",),
    **{f"bench {mode}": ("--out_dir",) for mode in ("compare", "depth", "scaling", "exits", "quality")},
}
"""Per command, the options naming a folder it writes: never in the repository's tracked folders
(`qkvflow.outputs.check_outside_repository`); whether an existing folder may be replaced needs the verb."""

STEPS = {"eval": (grids.GRIDS, False), "generate": (grids.ONE_GRID, True), "export": (grids.ONE_DEPTH, True)}
"""Per verb taking solver grids as `--steps`: (what it takes, whether only one grid), besides `auto`."""

MODEL_VERBS = ("train", "describe", "eval", "generate", "export", "analyze", "plan", "finetune", "sweep")
"""Verbs whose config names a model by `model.type` (a `qkvflow train` or `qkvflow finetune` config)."""


@functools.cache
def table() -> dict:
    return json.loads(TABLE.read_text(encoding="utf-8"))


def nearest(word: str, choices) -> str | None:
    """The choice that `word` begins (`h100` -> `H100-80GB`), else the closest by difflib's ratio (>= 0.6),
    case aside; None when none is close."""
    choices = list(choices)
    lower = {c.lower(): c for c in choices}
    starts = [c for c in choices if word and c.lower().startswith(word.lower())]
    close = starts or [lower[c] for c in difflib.get_close_matches(word.lower(), list(lower), n=1)]
    return close[0] if close else None


def did_you_mean(word: str, choices) -> str:
    """`; did you mean X?` for the `nearest` choice, else ``."""
    close = nearest(word, choices)
    return f"; did you mean {close}?" if close else ""


def command(verb: str, argv: list[str]) -> str:
    """The command whose help `argv` asks for: `verb`, or `verb SUB` for a sub-command."""
    if verb in SUBCOMMANDS and argv and not argv[0].startswith("-"):
        return f"{verb} {argv[0]}"
    return verb


def check(verb: str, argv: list[str]) -> bool:
    """Answer `--help` (True) or refuse what can be refused without the verb's stack (UserError);
    False lets the verb run."""
    sub = command(verb, argv)
    if sub != verb and sub not in table()["help"]:
        names = [c.split()[1] for c in table()["help"] if c.startswith(verb + " ")]
        kind = "bench mode" if verb == "bench" else "analysis"
        raise UserError(f"unknown {kind} {argv[0]!r}: expected one of {', '.join(names)}{did_you_mean(argv[0], names)}")
    if any(a in ("-h", "--help") for a in argv):
        sys.stdout.write(table()["help"][sub])
        return True
    config_path, rest = configfile.split_config_path(argv)
    path = configfile.check_config_file(config_path)
    check_config(path, argv)  # Levanter 1.2 keys
    args = configfile.overrides(verb, rest)
    if verb in MODEL_VERBS:
        check_model_types(path, args)
    check_keys(verb, path, args)
    check_outputs(sub, argv)
    for option in PATHS.get(verb, ()):
        for value in values(argv, option, many=option == "--files"):
            check_exists(option, value)
    if verb in STEPS and not _is_finetune_config(path):
        check_steps(verb, values(argv, "--steps"))
        for text in values(argv, "--auto_grids"):
            grids.steps_grammar(text, key="auto_grids")
    if verb == "plan":
        plan_checks(path, argv)
    return False


def check_outputs(command: str, argv: list[str]) -> None:
    """The output rules (docs/checkpoints.md, "Where outputs go") that need no config: the verb applies
    them again with what only it knows (the run folder, the checkpoint it reads)."""
    overwrite = any(
        a == "--overwrite" or (a.startswith("--overwrite=") and a.split("=", 1)[1].lower() in ("true", "1"))
        for a in argv
    )
    for option in OUTPUT_FILES.get(command, ()):
        for value in values(argv, option):
            outputs.check_file(value, option, overwrite=overwrite)
    for option in OUTPUT_FOLDERS.get(command, ()):
        for value in values(argv, option):
            outputs.check_outside_repository(value, option)


def values(argv: list[str], option: str, *, many: bool = False) -> list[str]:
    """The values given to `option` (`--option v`, `--option=v`; with `many`, every value up to the next
    `--option`). Null (`null`, `~`, empty) is no value."""
    out = []
    for i, arg in enumerate(argv):
        if arg.startswith(option + "="):
            given = [arg.split("=", 1)[1]]
        elif arg == option:
            given = []
            for value in argv[i + 1 :]:
                if value.startswith("--"):
                    break
                given.append(value)
                if not many:
                    break
        else:
            continue
        if many and len(given) == 1 and given[0].lstrip().startswith("["):  # a YAML list, as draccus takes it
            try:
                loaded = yaml.safe_load(given[0])
            except yaml.YAMLError:
                loaded = None
            given = [str(v) for v in loaded] if isinstance(loaded, list) else given
        out += [v for v in given if v.strip() not in ("", "null", "~", "None")]
    return out


def check_exists(option: str, value: str) -> None:
    if "://" in value or os.path.exists(value):  # a URL is the verb's to read
        return
    raise UserError(f"{option}: {value!r} does not exist (expected {WHAT[option]})")


def check_model_types(path, args: list[str]) -> None:
    """Every `model.type` of the config file and the overrides is a registered type."""
    known = table()["model_types"]
    for name in sorted(configfile.model_types(path, args) or ()):
        if name not in known:
            raise UserError(
                f"model.type {name!r} is unknown: expected one of {', '.join(known)}{did_you_mean(name, known)}"
            )


OWN_OPTIONS = {"sweep": ("depths", "methods")}
"""Options a draccus-parsed verb takes out of its command line before the parse (`qkvflow sweep`'s grid)."""


def check_keys(verb: str, path, args: list[str]) -> None:
    """The top-level keys of the config file and of the `--key...` overrides are fields of the verb's config
    (table.json's `keys`), or options of its own; only for the verbs whose whole command line is the config."""
    finetune = verb in ("eval", "generate") and _is_finetune_config(path)
    known = table()["keys"].get(f"{verb} finetune" if finetune else verb)
    if known is None:
        return
    known = [*known, *OWN_OPTIONS.get(verb, ())]
    try:
        with open(path) as f:
            tree = yaml.safe_load(f)
    except (TypeError, OSError, ValueError, yaml.YAMLError):
        tree = None
    for key in tree if isinstance(tree, dict) else ():
        if key not in known:
            hint = did_you_mean(str(key), known)
            raise UserError(f"{path}: unknown key {key!r}: expected one of {', '.join(known)}{hint}")
    for arg in args:
        if not arg.startswith("--") or arg == HELP_ALL:
            continue
        key = arg[2:].split("=", 1)[0]
        top = key.split(".", 1)[0]
        if top not in known:
            close = nearest(top, known)
            hint = f"; did you mean --{close}{key[len(top) :]}?" if close else ""
            raise UserError(f"command line: unknown key --{key}: expected one of {', '.join(known)}{hint}")


def check_steps(verb: str, given: list[str]) -> None:
    """`--steps` is a grid as `verb` takes it (`STEPS`). `export --steps auto` is the verb's to refuse (its
    message says how to choose M)."""
    expected, one = STEPS[verb]
    for text in given:
        if text.strip() == "auto":
            continue
        if verb == "export" and re.fullmatch(r"[+-]?\d+", text.strip()) and int(text) < 1:
            raise UserError(f"export: --steps {text} is invalid: expected an integer >= 1 (the number of layers)")
        items = grids.steps_grammar(text, expected=expected)
        if one and len(items) != 1:
            raise UserError(f"--steps {text!r} is invalid: expected {expected}")


def _is_finetune_config(path) -> bool:
    """A `qkvflow finetune` config (a `pretrained:` section), whose `steps` is its depth M, not a grid."""
    try:
        with open(path) as f:
            tree = yaml.safe_load(f)
    except (TypeError, OSError, ValueError, yaml.YAMLError):
        return False
    return isinstance(tree, dict) and "pretrained" in tree


# --- plan -------------------------------------------------------------------------------------------------

ICI_DEFAULT = {"data": -1, "replica": 1, "model": 1}
DCN_DEFAULT = {"replica_dcn": -1}
"""Levanter's default mesh axes (`levanter.utils.mesh.DEFAULT_ICI_AXIS_SPEC`, `DEFAULT_DCN_AXIS_SPEC`;
tests/test_cli_early.py pins them)."""


def plan_checks(path, argv: list[str]) -> None:
    """`qkvflow plan`: a known --target, --devices >= 1 (and not against cpu:N's N), and a mesh whose fixed
    axes can divide the devices."""
    target_names = values(argv, "--target")
    if not target_names:
        raise UserError(f"--target is missing: expected one of {', '.join(targets.known())}")
    name = target_names[-1]
    if not re.fullmatch(r"cpu(:\d+)?", name.strip().lower()) and name.strip().lower() not in {
        k.lower() for k in targets.TARGETS
    }:
        names = [*targets.TARGETS, "cpu:N"]
        raise UserError(f"--target {name!r} is unknown: expected one of {', '.join(names)}{did_you_mean(name, names)}")
    cpu = re.fullmatch(r"cpu(?::(\d+))?", name.strip().lower())
    n = int(cpu.group(1) or 1) if cpu else None
    given = values(argv, "--devices")
    devices = None
    if given:
        text = given[-1]
        if not re.fullmatch(r"[+-]?\d+", text.strip()):
            raise UserError(f"--devices {text!r} is invalid: expected an integer >= 1")
        devices = int(text)
        if devices < 1:
            raise UserError(f"--devices {devices} is invalid: expected an integer >= 1")
        if n is not None and devices != n:
            raise UserError(f"--devices {devices} contradicts --target {name}: give one of the two")
    check_mesh(mesh_axes(path, argv), devices or n or 1)


def mesh_axes(path, argv: list[str]):
    """(axes, dcn_axes) of `trainer.mesh` as the config file and the overrides give them (each None when
    not given), or None when they cannot be read here (a whole `--trainer` or `--trainer.mesh` override,
    or a value that is not a mapping of integers): the plan's own parse then decides."""
    found = {"axes": None, "dcn_axes": None}
    try:
        with open(path) as f:
            tree = yaml.safe_load(f) or {}
    except (TypeError, OSError, ValueError, yaml.YAMLError):
        tree = {}
    mesh = ((tree.get("trainer") or {}) if isinstance(tree, dict) else {}).get("mesh") or {}
    if not isinstance(mesh, dict):
        return None
    for key in found:
        found[key] = mesh.get(key)
    for arg in argv:
        key = arg.split("=", 1)[0]
        if key in ("--trainer", "--trainer.mesh") or re.match(r"--trainer\.mesh\.(dcn_)?axes\.", key):
            return None
    for key in found:
        given = values(argv, f"--trainer.mesh.{key}")
        if given:
            try:
                value = yaml.safe_load(given[-1])
            except yaml.YAMLError:
                return None
            found[key] = {**(found[key] or {}), **value} if isinstance(value, dict) else value
    for value in found.values():
        if value is not None and not (
            isinstance(value, dict) and all(isinstance(v, int) and not isinstance(v, bool) for v in value.values())
        ):
            return None
    return found["axes"], found["dcn_axes"]


def check_mesh(axes, devices: int) -> None:
    """Refuse a mesh that no split of `devices` into slices can give: more than one absorbing axis (-1) among
    the axes or among the DCN axes, an axis in both, or fixed sizes whose product does not divide the
    devices (or, with no absorbing axis at all, differs from them). Levanter's `MeshConfig.axis_shapes`
    refuses all of these, whatever the number of slices."""
    if axes is None:
        return
    ici, dcn = axes
    ici = {**ICI_DEFAULT, **(ici or {})}
    dcn = {**DCN_DEFAULT, **(dcn or {})}
    given_ici, given_dcn = (axes[0] or {}), (axes[1] or {})
    if sum(v == -1 for v in ici.values()) > 1 and "data" not in given_ici:
        ici["data"] = 1  # as Levanter: another absorber replaces the default one
    if sum(v == -1 for v in dcn.values()) > 1 and "replica_dcn" not in given_dcn:
        dcn["replica_dcn"] = 1
    where = f"trainer.mesh does not fit {devices} devices"
    both = sorted(set(ici) & set(dcn))
    if both:
        raise UserError(f"{where}: {', '.join(both)} is in both axes and dcn_axes")
    for name, group in (("axes", ici), ("dcn_axes", dcn)):
        if sum(v == -1 for v in group.values()) > 1:
            raise UserError(f"{where}: only one of trainer.mesh.{name} may be -1")
        bad = [k for k, v in group.items() if v != -1 and v < 1]
        if bad:
            raise UserError(f"{where}: trainer.mesh.{name}.{bad[0]}={group[bad[0]]} (expected an integer >= 1 or -1)")
    fixed = {k: v for k, v in {**ici, **dcn}.items() if v not in (-1, 1)}
    product = 1
    for v in fixed.values():
        product *= v
    absorbing = any(v == -1 for v in {**ici, **dcn}.values())
    if (devices % product) if absorbing else (devices != product):
        sizes = " x ".join(f"{k}={v}" for k, v in fixed.items()) or "1"
        need = f"a multiple of {product}" if absorbing else f"exactly {product}"
        raise UserError(f"{where}: the fixed axes ({sizes}) need {need} devices")
