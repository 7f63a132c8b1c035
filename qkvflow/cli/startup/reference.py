"""The configuration reference, written from the config dataclasses themselves: every key, its type,
its default and the docstring below the field (the comment `--help` shows, read with the same
`draccus.wrappers.docstring.get_attribute_docstring`). The documentation site builds its configuration
page from `reference()` (docs/hooks/site.py), so a renamed field, a new default or an edited docstring
reaches the page with the next build: the page cannot drift from the code.

A section whose type is a dataclass of qkvflow's is expanded as `section.key` rows (`model.ode.solver`);
Levanter's own sections (trainer, data, optimizer) list their top-level keys, whose nested keys
`qkvflow train --help-all` lists.
"""

import dataclasses
import enum
import re
import typing

from draccus.wrappers import docstring
from levanter.data.text import LmDataConfig
from levanter.optim import AdamConfig
from levanter.trainer import TrainerConfig

from qkvflow.cli.describe import DescribeConfig
from qkvflow.cli.eval import EvalConfig
from qkvflow.cli.generate import GenerateConfig
from qkvflow.cli.tokenizer import TokenizerConfig
from qkvflow.finetune.run import FinetuneConfig
from qkvflow.models import registry
from qkvflow.runs.config import TrainConfig
from qkvflow.runs.tracking import JsonlTrackerConfig

MAX_DEFAULT = 60
"""Defaults whose text is longer are shown cut, with an ellipsis."""
EXPANDED = ("qkvflow.",)
"""Dataclasses from these packages are expanded in place as dotted keys (Levanter's are not)."""
TOOL_COMMENT = re.compile(r"\s*(type:|noqa|fmt:|pragma)")
"""Comments beside a field that speak to a tool, not to the reader (`# type: ignore`)."""


def field_docstring(cls: type, name: str) -> str:
    """The docstring below field `name` (else the comment beside or above it), from the class of
    `cls`'s MRO that declares the field (a config made of mixins declares options in a base)."""
    for owner in cls.__mro__:
        if dataclasses.is_dataclass(owner) and name in vars(owner).get("__annotations__", {}):
            doc = docstring.get_attribute_docstring(owner, name)
            comments = [c for c in (doc.comment_inline, doc.comment_above) if c and not TOOL_COMMENT.match(c)]
            text = doc.docstring_below or next(iter(comments), "")
            if text:
                return " ".join(text.split())
    return ""


def default_text(f: dataclasses.Field) -> str:
    """The default as YAML would write it; `(required)` when there is none."""
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
    else:
        return "(required)"
    if dataclasses.is_dataclass(value):
        return f"`{type(value).__name__}()`"
    if isinstance(value, enum.Enum):
        value = value.value
    text = "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)
    text = text if len(text) <= MAX_DEFAULT else text[: MAX_DEFAULT - 1] + "…"
    return f"`{text}`"


def type_text(tp) -> str:
    """A short name for a field's type: `int`, `str | null`, `list[int]`, `OdeConfig`."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Union:
        names = [type_text(a) for a in args if a is not type(None)]
        return " | ".join(names) + (" | null" if type(None) in args else "")
    if origin is not None:
        inner = ", ".join(type_text(a) for a in args)
        return f"{getattr(origin, '__name__', str(origin))}[{inner}]" if inner else getattr(origin, "__name__", "")
    return getattr(tp, "__name__", str(tp).replace("typing.", ""))


def expandable(tp) -> type | None:
    """The qkvflow dataclass a field holds (Optional included), expanded in place; None otherwise."""
    candidates = [a for a in typing.get_args(tp) if a is not type(None)] or [tp]
    for c in candidates:
        if isinstance(c, type) and dataclasses.is_dataclass(c) and c.__module__.startswith(EXPANDED):
            return c
    return None


def rows(cls: type, prefix: str = "", *, expand: bool = True) -> list[tuple[str, str, str, str]]:
    """(key, type, default, doc) for every field of `cls`, nested qkvflow dataclasses as dotted keys."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        tp = hints.get(f.name, f.type)
        nested = expandable(tp) if expand else None
        doc = field_docstring(cls, f.name)
        if nested is not None:
            default = "null" if f.default is None else None
            out.append((prefix + f.name, type_text(tp), f"`{default}`" if default else "(section)", doc))
            out += rows(nested, f"{prefix}{f.name}.")
        else:
            out.append((prefix + f.name, type_text(tp), default_text(f), doc))
    return out


def table(cls: type, prefix: str = "", *, expand: bool = True, only: typing.Iterable[str] | None = None) -> str:
    """A markdown table of `rows(cls)`; `only`: the top-level fields to keep."""
    keep = None if only is None else {prefix + name for name in only}
    lines = ["| key | type | default | meaning |", "|---|---|---|---|"]
    for key, tp, default, doc in rows(cls, prefix, expand=expand):
        if keep is not None and not any(key == k or key.startswith(k + ".") for k in keep):
            continue
        lines.append(f"| `{key}` | {_cell(tp)} | {default} | {_cell(doc)} |")
    return "\n".join(lines)


def _cell(text: str) -> str:
    """`text` as one table cell: pipes escaped, and `<`, `>` outside code spans written as entities, so
    that `runs/<run_id>/` is not read as an HTML tag."""
    parts = text.replace("|", "\\|").replace("\n", " ").split("`")
    parts[::2] = [p.replace("<", "&lt;").replace(">", "&gt;") for p in parts[::2]]
    return "`".join(parts)


def _own_fields(cls: type, base: type) -> list[str]:
    return [f.name for f in dataclasses.fields(cls) if f.name not in {g.name for g in dataclasses.fields(base)}]


def reference() -> str:
    """The configuration page's body: the top-level keys, each qkvflow model family, the verbs' own
    options, then Levanter's sections."""
    sections = {"data", "trainer", "model", "optimizer"}
    top = [f.name for f in dataclasses.fields(TrainConfig) if f.name not in sections]
    out = ["## Top level (`qkvflow train`)", "", table(TrainConfig, only=top), ""]
    out += ["## `model`", ""]
    out += ["`model.type` chooses the family; Levanter's own `gpt2` and `llama` take Levanter's keys.", ""]
    for family in sorted(registry.families(), key=lambda f: (not f.ode, f.name)):
        cls = family.config_class
        kind = "continuous depth" if family.ode else "a stack of layers"
        then = f"; discretises to `{family.discretises_to}`" if family.discretises_to else ""
        out += [f"### `type: {family.name}`", ""]
        out += [f"`{cls.__module__}.{cls.__name__}`: {kind}, {family.flavour.name} flavour{then}.", ""]
        out += [table(family.config_class, "model."), ""]
    out += ["## `qkvflow finetune` and `qkvflow sweep`", ""]
    out += ["A fine-tuning config is a training config (above) and these keys:", ""]
    out += [table(FinetuneConfig, only=_own_fields(FinetuneConfig, TrainConfig)), ""]
    out += _verb_options()
    out += ["## `trainer.tracker: {type: jsonl}`", "", table(JsonlTrackerConfig, "trainer.tracker."), ""]
    levanter = [("trainer", TrainerConfig), ("optimizer", AdamConfig), ("data", LmDataConfig)]
    for name, cls in levanter:
        out += [f"## `{name}` (Levanter's `{cls.__name__}`)", ""]
        out += ["Top-level keys; `qkvflow train --help-all` lists the nested ones.", ""]
        out += [table(cls, f"{name}.", expand=False), ""]
    return "\n".join(out)


def _verb_options() -> list[str]:
    """The options each of eval, generate, describe and tokenizer adds to its config."""
    out = []
    for verb, cls in (
        ("eval", EvalConfig),
        ("generate", GenerateConfig),
        ("describe", DescribeConfig),
        ("tokenizer", TokenizerConfig),
    ):
        own = _own_fields(cls, TrainConfig) if issubclass(cls, TrainConfig) else None
        what = "these options besides the training config's keys" if own is not None else "these options"
        out += [f"## `qkvflow {verb}`", "", f"`qkvflow {verb}` takes {what}:", "", table(cls, only=own), ""]
    return out
