"""Reading a config the one way every verb does: a YAML file (`--config_path`, local or a URL) plus
`--dotted.key value` overrides, parsed into a dataclass by draccus (`parse`).

Library code that reads a config file (fine-tuning reads its pretrained run's config) uses the same
function, so the command line and the library accept the same files; `qkvflow.cli` re-exports it.
"""

import contextlib
import json

from qkvflow.errors import UserError

CONFIG_PATH = "--config_path"


def split_config_path(argv: list[str]) -> tuple[str | None, list[str]]:
    """(the --config_path value or None, argv without it). `--config_path X` and `--config_path=X`;
    given more than once, or without a value, is a UserError."""
    paths, rest = [], []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg.startswith(CONFIG_PATH + "="):
            paths.append(arg.split("=", 1)[1])
        elif arg == CONFIG_PATH:
            if i + 1 >= len(argv) or argv[i + 1].startswith("--"):
                raise UserError(f"{CONFIG_PATH} needs a value: expected a YAML config file")
            paths.append(argv[i + 1])
            i += 1
        else:
            rest.append(arg)
        i += 1
    if len(paths) > 1:
        raise UserError(f"{CONFIG_PATH} is given {len(paths)} times ({', '.join(paths)}): expected one")
    return (paths[0] if paths else None), rest


def check_config_file(path):
    """The --config_path file: it exists, is UTF-8 YAML (a syntax error is named with PyYAML's line and
    column), and holds a mapping of sections. Light (no draccus or Levanter): `qkvflow.cli.startup.early` runs it
    before the verb imports its stack. Returns the file as Levanter
    finds it (`path`, `path.yaml` or `path.yml`), or `path` itself if remote or None."""
    import os

    import yaml

    if path is None or "://" in path:
        return path  # remote configs are read by Levanter (fsspec)
    path = next((p for p in (path, f"{path}.yaml", f"{path}.yml") if os.path.isfile(p)), path)  # as Levanter looks
    if not os.path.isfile(path):
        what = "is a folder" if os.path.isdir(path) else "does not exist"
        raise UserError(f"config file {path!r} {what} (expected a YAML file, e.g. configs/quickstart.yaml)")
    with open(path, "rb") as f:
        raw = f.read()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[: e.start].count(b"\n") + 1
        raise UserError(f"config file {path!r} is not UTF-8 text (line {line}, byte {e.start})") from None
    try:
        content = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise UserError(f"{path} is not valid YAML: {' '.join(str(e).split())}") from None
    if content is None:
        raise UserError(f"config file {path!r} is empty (expected sections such as model:, trainer:, data:)")
    if not isinstance(content, dict):
        raise UserError(
            f"config file {path!r} holds a {type(content).__name__} (expected a mapping of sections such as "
            "model:, trainer:, data:)"
        )
    return path


def _readable_config(path: str) -> str:
    """What Levanter's `levanter.config.main` did with a --config_path: a URL (gs://, s3://, file://, ...)
    is copied to a local temporary file (fsspec; removed at exit); a local `path` may omit `.yaml`/`.yml`."""
    import os
    import urllib.parse

    if urllib.parse.urlparse(path).scheme:
        import atexit
        import tempfile

        import fsspec

        with fsspec.open(path, "rb") as remote:
            text = remote.read()
        fd, local = tempfile.mkstemp(prefix="qkvflow_config_", suffix=".yaml")
        with os.fdopen(fd, "wb") as f:
            f.write(text)
        atexit.register(os.remove, local)
        return local
    return next((p for p in (path, f"{path}.yaml", f"{path}.yml") if os.path.exists(p)), path)


def parse(cls, argv: list[str], verb: str, *, required: str | None = None):
    """The one way every verb reads its config: `cls` from the --config_path file (`--config_path X` or
    `--config_path=X`; local, or a URL as Levanter reads it) and the overrides in argv, rewritten by
    `overrides(verb, ...)`, parsed by draccus. `required`: what the missing --config_path should have been
    (a UserError); without it, no --config_path parses cls's defaults. draccus's errors are left to `main`,
    which makes them one line."""
    import draccus
    import levanter.config  # noqa: F401  (registers Levanter's draccus codecs: dtypes, jmp.Policy, timedelta, ...)

    from qkvflow.models.registry import only_named_types  # lazy: registry imports Levanter; CLI light path

    memoise_field_docstrings()
    path, args = split_config_path(argv)
    if path is None and required:
        raise UserError(f"{CONFIG_PATH} is missing: expected {required}")
    if path is not None:
        path = _readable_config(path)
    args = overrides(verb, args)
    with only_named_types(model_types(path, args)):
        if "--help" in args or "-h" in args:  # help text from a parser no parse has touched (see `_parser`)
            return draccus.parse(cls, config_path=path, args=args)
        parser = _parser(cls)
        parser.config_path = path
        return parser.parse_args(args)


_PARSERS: dict = {}


def _parser(cls):
    """draccus's parser for `cls`, built once per config class and state of draccus's choice registries.

    `draccus.parse` builds an argparse parser of every field of the config tree, every registered model,
    optimizer and tracker type's fields included, on each call: about a thousand actions, 0.4-2 s of
    each parse of TrainConfig on the 2-core VM, spent again by every later parse in the process (`bench
    compare` reads each run's config, a fine-tune its pretrained run's, the tests hundreds). The parser
    is a function of the class and of which types are registered, so it is kept per (class, registries)
    and reused; a type registered later (an import, Levanter's search for its model types) makes a new
    key. Reusing one is what draccus's own `ArgumentParser.parse_args` allows: its first call sets every
    action's default and type once (the same on every call) and the file to read is `config_path`,
    set per parse. Help is the exception (`parse` builds a fresh parser for it): those settings change
    the help text. tests/test_configfile.py checks a reused parser gives what a fresh one gives."""
    from draccus.argparsing import ArgumentParser

    key = (cls, _registries())
    if key not in _PARSERS:
        with _without_field_docstrings():
            _PARSERS[key] = ArgumentParser(config_class=cls, exit_on_error=True)
    return _PARSERS[key]


@contextlib.contextmanager
def _without_field_docstrings():
    """Within the block, draccus finds no field comments. They are only help text, and `_parser`'s
    parsers never print help (`parse` builds a fresh parser for --help). Looking them up is most of
    building a parser: Python 3.11's `inspect.getsource` parses a class's whole module for each class,
    ~0.7 s of the first parse of TrainConfig in a process on the 2-core VM, in every `qkvflow` process.
    tests/test_configfile.py checks the parse gives the same config and --help still lists comments."""
    from draccus.wrappers import docstring

    lookup = docstring.get_attribute_docstring
    docstring.get_attribute_docstring = lambda cls, field_name: docstring.AttributeDocString()
    try:
        yield
    finally:
        docstring.get_attribute_docstring = lookup


def _registries() -> tuple:
    """What the draccus choice registries hold now: each registry's class, registered names and (for a
    plugin registry) whether it has searched its package. Reads `_choice_registry` and
    `_did_discover_packages` without calling `get_known_choices`, which would start that search."""
    from draccus.choice_types import ChoiceRegistryBase

    state, todo = [], [ChoiceRegistryBase]
    while todo:
        registry = todo.pop()
        todo += registry.__subclasses__()
        if "_choice_registry" in vars(registry):
            names = tuple(registry._choice_registry)
            state.append((registry, names, vars(registry).get("_did_discover_packages")))
    return tuple(state)


def memoise_field_docstrings() -> None:
    """Look each config field's comment up once per process, not once per parser built.

    draccus builds the help text of every field whenever it builds a parser, finding a field's comment
    by scanning its class's source, and its base classes' in turn: `draccus.wrappers.docstring.
    get_attribute_docstring`, about 1,500 lookups for TrainConfig. A parse's parser skips them
    (`_without_field_docstrings`); a `--help` builds a parser with them, and a process may build several
    (draccus's registries change as types are found). A class's source does not change while the process
    runs, so the answer is memoised; draccus's own source has the same cache commented out. The help text
    is unchanged (tests/test_configfile.py), and that test fails when draccus moves the function."""
    import functools

    from draccus.wrappers import docstring

    if not hasattr(docstring.get_attribute_docstring, "cache_info"):
        docstring.get_attribute_docstring = functools.cache(docstring.get_attribute_docstring)


def model_types(path: str | None, args: list[str]) -> set | None:
    """The `model.type` names that the config file and the overrides give (empty when neither names one:
    the config class's default), or None when they cannot be read off them: a file or value that is not
    YAML, a `model` that is not a mapping, `--help`. With None, draccus searches all of Levanter's types
    (`qkvflow.models.registry.only_named_types`)."""
    import yaml

    names = []
    if path is not None:
        try:
            with open(path) as f:
                tree = yaml.safe_load(f)
        except Exception:  # draccus reports it
            return None
        tree = {} if tree is None else tree
        if not isinstance(tree, dict):
            return None
        model = tree.get("model")
        if isinstance(model, dict):
            names += [model["type"]] if "type" in model else []
        elif model is not None:
            return None
    for i, arg in enumerate(args):
        key, eq, value = arg.partition("=")
        if key in ("--help", "-h"):
            return None
        if key not in ("--model", "--model.type"):
            continue
        if not eq:
            if i + 1 >= len(args):
                return None
            value = args[i + 1]
        try:
            tree = yaml.safe_load(value) if key == "--model" else {"type": value}
        except Exception:
            return None
        if not isinstance(tree, dict):
            return None
        names += [tree["type"]] if "type" in tree else []
    return set(names) if all(isinstance(n, str) for n in names) else None


# Verbs whose config is a TrainConfig (with its `verbose` flag), parsed by draccus from the command line.
FLAG_VERBS = ("train", "finetune", "sweep", "describe", "eval", "generate")
FLAGS = ("--verbose", "--overwrite", "--stream")
"""Boolean config fields that may be given bare (`--verbose` for `--verbose true`)."""

COMPONENTS = "--data.components"


def overrides(verb: str, args: list[str]) -> list[str]:
    """The overrides as draccus reads them.

    * A bare boolean flag (`--verbose`, followed by nothing or by another `--key`) gets the value `true`:
      draccus's parser wants a value for every field.
    * `--data.components.NAME.KEY... VALUE` (a key inside one of LmDataConfig's named components, e.g.
      `--data.components.owt.cache_dir /fast/owt`) becomes one `--data.components '{NAME: {KEY: VALUE}}'`:
      draccus reads a dict-valued field only whole, and merges that mapping into the config file's
      components, so the rest of the component is kept. Lists and mappings in VALUE are YAML.
    """
    import yaml

    out, merged, at = [], {}, None
    i = 0
    while i < len(args):
        arg = args[i]
        key, eq, value = arg.partition("=") if arg.startswith("--") else (arg, "", "")
        has_next = i + 1 < len(args)
        if verb in FLAG_VERBS and arg in FLAGS and (not has_next or args[i + 1].startswith("--")):
            out += [arg, "true"]
        elif key.startswith(COMPONENTS + "."):
            if not eq:
                if not has_next:
                    out.append(arg)  # draccus names the missing value
                    break
                value, i = args[i + 1], i + 1
            loaded = yaml.safe_load(value)
            if not isinstance(loaded, (list, dict)) and loaded is not None:
                loaded = value  # a scalar stays the text the user wrote; draccus converts it to the field's type
            tree = loaded
            for part in reversed(key[len(COMPONENTS) + 1 :].split(".")):
                tree = {part: tree}
            _deep_merge(merged, tree)
            if at is None:
                at = len(out)
                out.append(None)
        else:
            out.append(arg)
        i += 1
    if at is not None and any(a == COMPONENTS or a.startswith(COMPONENTS + "=") for a in out if a):
        raise UserError(f"{COMPONENTS} is given whole and also by key ({COMPONENTS}.NAME.KEY): expected one of the two")
    if at is not None:
        out[at : at + 1] = [COMPONENTS, json.dumps(merged)]
    return out


def _deep_merge(into: dict, tree: dict) -> None:
    for k, v in tree.items():
        if isinstance(v, dict) and isinstance(into.get(k), dict):
            _deep_merge(into[k], v)
        else:
            into[k] = v


def _user_cause(error: BaseException):
    """The first UserError among an exception's causes (draccus wraps what a constructor raised)."""
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, UserError):
            return error
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return None


def blamed_flag(error: BaseException, argv: list[str]) -> str | None:
    """The command-line override (`--dotted.key`) that a draccus error is about, or None when the
    value came from the config file. draccus names the key of a value it cannot decode (`key_path`);
    a value that a config class refuses is named at the start of that class's message
    (`ode.solver='foo' is invalid`, `num_heads=5 is invalid`), relative to the class."""
    import re

    import draccus.utils

    keys = [a[2:].partition("=")[0] for a in argv if a.startswith("--") and not a.startswith(CONFIG_PATH)]
    decoding = next(
        (e for e in (error, error.__cause__) if isinstance(e, draccus.utils.DecodingError) and e.key_path), None
    )
    if decoding is not None:
        path = list(decoding.key_path)
        for key in keys:
            parts = key.split(".")
            if path[: len(parts)] == parts or parts[: len(path)] == path:
                return f"--{key}"
        return None
    cause = _user_cause(error)
    named = re.match(r"([A-Za-z_][\w.]*)=", str(cause)) if cause is not None else None
    if named is None:
        return None
    name = named.group(1)
    return next((f"--{k}" for k in keys if k == name or k.endswith("." + name)), None)
