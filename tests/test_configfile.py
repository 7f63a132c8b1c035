"""qkvflow.configfile: what the one config reader adds to draccus (memoised field comments, one parser per
config class and registry state)."""

import dataclasses
from pathlib import Path

from tests.train_utils import TINY


def test_a_second_parse_reads_no_class_source_and_gives_the_same_config(monkeypatch):
    """The first parse looks every field's comment up in its class's source; the second finds them all
    memoised. Fails if draccus stops calling the lookup through its module (our cache then never runs)."""
    from draccus.wrappers import docstring

    from qkvflow.configfile import parse
    from qkvflow.training.config import TrainConfig

    argv = ["--config_path", TINY, "--model.num_heads", "4"]
    first = parse(TrainConfig, argv, "train")
    reads, read_source = [], docstring._get_class_source
    monkeypatch.setattr(docstring, "_get_class_source", lambda cls: reads.append(cls) or read_source(cls))
    assert parse(TrainConfig, argv, "train") == first and first.model.num_heads == 4
    assert reads == []


def test_memoised_comments_are_draccus_own():
    """Every field of the run config's sections: the memoised lookup answers what draccus's own does."""
    from draccus.wrappers import docstring
    from levanter.trainer import TrainerConfig

    from qkvflow.configfile import memoise_field_docstrings
    from qkvflow.integrate.config import OdeConfig
    from qkvflow.models.depth_dial import DepthDialConfig
    from qkvflow.models.diffeqformer import DiffEqFormerConfig
    from qkvflow.training.config import TrainConfig

    memoise_field_docstrings()
    lookup = docstring.get_attribute_docstring
    assert lookup.__wrapped__.__module__ == "draccus.wrappers.docstring"
    for cls in (TrainConfig, TrainerConfig, DiffEqFormerConfig, OdeConfig, DepthDialConfig):
        for field in dataclasses.fields(cls):
            assert lookup(cls, field.name) == lookup.__wrapped__(cls, field.name), (cls, field.name)
    assert lookup(DepthDialConfig, "jitter").docstring_below.startswith("In [0, 1): inner grid times")


def _fresh(cls, path, args):
    """What draccus gives for `path` and `args` from a parser built for this parse alone."""
    import draccus

    from qkvflow.configfile import model_types
    from qkvflow.models.registry import only_named_types

    with only_named_types(model_types(path, args)):
        return draccus.parse(cls, config_path=path, args=args)


def test_a_reused_parser_reads_each_parse_own_file_and_overrides():
    """Parses of one class share one parser: the second, of another file with other overrides, builds
    none and gives what a parser of its own gives, and the first parse's file and overrides do not leak."""
    from qkvflow import configfile
    from qkvflow.training.config import TrainConfig

    quickstart = str(Path(TINY).parents[2] / "configs" / "quickstart.yaml")
    first = configfile.parse(TrainConfig, ["--config_path", TINY, "--model.num_heads", "4"], "train")
    parsers = dict(configfile._PARSERS)
    second = configfile.parse(TrainConfig, ["--config_path", quickstart, "--trainer.seed", "7"], "train")
    assert configfile._PARSERS == parsers  # reused, not built again
    assert first == _fresh(TrainConfig, TINY, ["--model.num_heads", "4"]) and first.model.num_heads == 4
    assert second == _fresh(TrainConfig, quickstart, ["--trainer.seed", "7"])
    assert (
        second.trainer.seed == 7
        and second.model.hidden_dim != first.model.hidden_dim
        and second.trainer.id != first.trainer.id
    )


def test_a_model_type_registered_after_a_parse_gets_a_parser_that_knows_its_fields():
    """A parser is kept per state of draccus's registries: a type registered later (an import of a module
    that registers one) gets a parser with its fields, not the stale one that would refuse them."""
    from levanter.models.lm_model import LmConfig

    from qkvflow import configfile
    from qkvflow.models.diffeqformer import DiffEqFormerGpt2Config
    from qkvflow.training.config import TrainConfig

    configfile.parse(TrainConfig, ["--config_path", TINY], "train")
    name = "qkvflow_test_registered_later"

    @dataclasses.dataclass(frozen=True)
    class Later(DiffEqFormerGpt2Config):
        later_knob: int = 1

    LmConfig.register_subclass(name)(Later)
    try:
        config = configfile.parse(
            TrainConfig, ["--config_path", TINY, "--model.type", name, "--model.later_knob", "3"], "train"
        )
        assert type(config.model) is Later and config.model.later_knob == 3
    finally:
        del LmConfig._choice_registry[name]


def test_help_comes_from_a_parser_no_parse_has_used(capsys):
    """A parse sets every action's default and type (draccus's `parse_known_args`), which changes the help
    text: `--help` after a parse still lists each field's own type, as a process's first parse does. Once
    Levanter's model types are all found (as here), a parse and a help parse see the same registries."""
    import pytest
    from draccus.argparsing import ArgumentParser
    from levanter.models.lm_model import LmConfig

    from qkvflow import configfile
    from qkvflow.models.registry import only_named_types
    from qkvflow.training.config import TrainConfig

    LmConfig.get_known_choices()  # the search for every type, which a help parse would start
    configfile.parse(TrainConfig, ["--config_path", TINY], "train")
    capsys.readouterr()
    with pytest.raises(SystemExit):
        configfile.parse(TrainConfig, ["--config_path", TINY, "--help"], "train")
    shown = capsys.readouterr().out
    with only_named_types(None):
        ArgumentParser(config_class=TrainConfig, exit_on_error=True).parser.print_help()
    assert shown == capsys.readouterr().out and "[--trainer.seed int]" in shown
