"""`--help` of the config-driven verbs (train, finetune, sweep, describe): one screen, not draccus's listing.

Draccus lists every key of every nested config (Levanter's trainer, data, optimizer and every model type
Levanter and qkvflow register: thousands of lines, growing with each model type). `--help` prints the
verb's own options (the top-level fields of its config, with their docstrings and defaults), one line per
config section (the model types listed from qkvflow.models.registry, so the list cannot fall behind it)
and the verb's own documentation page (`REFERENCE`); `--help-all` keeps draccus's full listing.
"""

import dataclasses
import textwrap
import typing

HELP_ALL = "--help-all"
FLAGS = ("verbose", "overwrite", "stream")
"""Boolean options listed bare (`--verbose`): qkvflow.cli.overrides gives them the value draccus needs."""

SECTIONS = {
    "data": "Levanter's LmDataConfig: tokenizer, and named components, each a source (data.components.<name>.source: "
    "type url with train_urls / validation_urls (.jsonl with a `text` field, .json or .parquet, optionally "
    "compressed; not .txt), type hf with a Hugging Face dataset id, or type hf_heldout) and a cache_dir; "
    "override one key with --data.components.<name>.cache_dir DIR",
    "corpus": "build one of qkvflow's offline corpora and point `data` at it: name (pydoc, tinyshakespeare), "
    "root, vocab_size, eval_split; other text in its tokenizer: --data.components.<name>.source.validation_urls "
    "'[file.jsonl]'",
    "trainer": "Levanter's trainer: id, num_train_steps, train_batch_size, seed, mp, steps_per_eval, "
    "max_eval_batches, checkpointer, tracker, log_dir, mesh (axes, param_mapping, shared_mapping), distributed",
    "optimizer": "Levanter's AdamW: learning_rate, weight_decay, beta1, beta2, warmup, lr_schedule, min_lr_ratio",
    "pretrained": "the ODE run to start from: config_path, checkpoint, overrides",
    "lora": "Levanter's LoRA: r, alpha, dropout, target_modules",
    "export": "what to write at the end: hf_dir, peft_dir, merged",
    "sweep": "the grid of `qkvflow sweep`: depths, methods, out_dir, learning_rate (per method)",
}
REFERENCE = {
    "train": "docs/training.md",
    "export": "docs/export.md",
    "analyze": "docs/analysis.md",
    "finetune": "docs/finetune.md",
    "sweep": "docs/finetune.md",
    "eval": "docs/evaluate.md",
    "generate": "docs/generate.md",
    "describe": "docs/model.md",
    "tokenizer": "docs/own_text.md",
    "plan": "docs/plan.md",
}
"""Each verb's documentation page (relative to the repository root), named at the end of its `--help`."""


def footer(verb: str) -> str:
    """The last line of `qkvflow <verb> --help`: the verb's page (`REFERENCE`; the front page for a verb
    without one, which tests/test_usage.py refuses)."""
    return f"reference: {REFERENCE.get(verb, 'README.md')}"


def model_section() -> str:
    """The `model` section's line: every model type that qkvflow declares (qkvflow.models.registry), those
    with weights W(t) (`Family.ode`) first, then Levanter's own baselines, and the DiffEqFormer's main keys."""
    from qkvflow.models import registry  # lazy: imports Levanter; early imports this module for HELP_ALL

    ode = [f.name for f in registry.families() if f.ode]
    discrete = [f.name for f in registry.families() if not f.ode]
    return (
        f"the model, chosen by `type`: with weights W(t), depth chosen when run: {', '.join(ode)}; "
        f"qkvflow's other models: {', '.join(discrete)}; "
        "Levanter's gpt2, llama. A DiffEqFormer: hidden_dim, num_heads, max_seq_len, time_embed_dim, "
        "ode.num_steps, ode.solver, variant (qkvflow, or official: the authors' hypernetworks), ..."
    )


def wants_help(argv: list[str]) -> bool:
    return any(a in ("-h", "--help") for a in argv)


def full_listing_args(argv: list[str]) -> list[str]:
    """argv with `--help-all` turned into draccus's `--help`."""
    return ["--help" if a == HELP_ALL else a for a in argv]


def short_help(
    prog: str, config_cls, summary: str, *, hide: tuple[str, ...] = (), extra: tuple[tuple[str, str], ...] = ()
) -> str:
    """`prog`'s usage, its own options (`extra`, then config_cls's top-level fields that are not sections)
    and one line per section of config_cls."""
    from draccus.wrappers.docstring import get_attribute_docstring  # lazy: draccus, as registry above

    hints = typing.get_type_hints(config_cls)
    options, sections = list(extra), []
    for f in dataclasses.fields(config_cls):
        if f.name in hide:
            continue
        doc = _docstring(config_cls, f.name, get_attribute_docstring)
        if f.name == "model":
            sections.append((f.name, model_section()))
        elif f.name in SECTIONS or _is_dataclass_type(hints.get(f.name)):
            sections.append((f.name, SECTIONS.get(f.name) or _first_paragraph(doc)))
        elif f.name in FLAGS and hints.get(f.name) is bool:
            options.append((f"--{f.name}", _first_paragraph(doc)))  # bare: qkvflow.cli turns it into `true`
        else:
            options.append((f"--{f.name} {_type_name(hints.get(f.name))}", _with_default(doc, f)))
    lines = [f"usage: {prog} --config_path CFG [--dotted.key value ...]", "", summary.strip(), ""]
    lines += ["options:", *_rows([("--config_path CFG", "the YAML config"), *options]), ""]
    if sections:  # (`qkvflow tokenizer` has none)
        lines += ["config sections (set any key in the YAML, or override it: --trainer.num_train_steps 100):"]
        lines += _rows(sections) + [""]
    lines += [f"every key with its default: {prog} {HELP_ALL}", footer(prog.split()[-1])]
    return "\n".join(lines)


def _docstring(config_cls, name: str, get_attribute_docstring) -> str:
    """The docstring below field `name`, from the class of the MRO that declares it (a config made of
    mixins, e.g. `EvalConfig(TrainConfig, EvalOptions)`, declares its options in a base)."""
    for cls in config_cls.__mro__:
        if dataclasses.is_dataclass(cls) and name in getattr(cls, "__annotations__", {}):
            doc = get_attribute_docstring(cls, name).docstring_below
            if doc:
                return doc
    return ""


def _rows(rows, width: int = 100) -> list[str]:
    left = max(len(name) for name, _ in rows) + 2
    out = []
    for name, text in rows:
        wrapped = textwrap.wrap(" ".join(text.split()), width - 2 - left) or [""]
        out.append(f"  {name:<{left}}{wrapped[0]}")
        out += [" " * (2 + left) + line for line in wrapped[1:]]
    return out


def _is_dataclass_type(tp) -> bool:
    args = typing.get_args(tp)
    if args:
        return any(_is_dataclass_type(a) for a in args)
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def _type_name(tp) -> str:
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if typing.get_origin(tp) is typing.Union and len(args) == 1:
        tp = args[0]
    return getattr(tp, "__name__", str(tp).replace("typing.", "")).upper()


def _first_paragraph(doc: str) -> str:
    return doc.strip().split("\n\n")[0]


def _with_default(doc: str, f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        default = f.default
    elif f.default_factory is not dataclasses.MISSING:
        default = f.default_factory()
    else:
        return _first_paragraph(doc)
    return f"{_first_paragraph(doc)} (default: {'null' if default is None else default})".strip()
