"""`qkvflow VERB ...`: a thin dispatcher; each verb's work lives in its own module."""

import importlib
import sys

VERBS = {
    "train": ("qkvflow.train", "train a model with Levanter (--config_path CFG [--key value ...])"),
    "describe": ("qkvflow.describe", "parameter counts and FLOPs of a config, as JSON"),
}


def usage() -> str:
    lines = ["usage: qkvflow VERB [--config_path CFG] [--dotted.key value ...]", "", "verbs:"]
    lines += [f"  {verb:<10} {help}" for verb, (_, help) in VERBS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        return 0
    verb, rest = argv[0], argv[1:]
    if verb not in VERBS:
        print(f"qkvflow: unknown verb {verb!r}\n\n{usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(VERBS[verb][0])
    return module.main(rest) or 0
