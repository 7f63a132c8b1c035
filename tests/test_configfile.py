"""qkvflow.runs.configfile: what the one config reader adds to draccus (field comments memoised for help and
skipped by a parse, one parser per config class and registry state)."""

import dataclasses
from pathlib import Path

from tests.train_utils import TINY


def test_a_parse_looks_up_no_field_comment_and_gives_what_a_parser_with_comments_gives(monkeypatch):
    """Field comments are help text, which a parse's parser never prints (`--help` builds its own): building
    it looks none up, and the config it gives is the one a parser built with every comment gives. Fails if
    draccus stops calling the lookup through its module (then the lookups are not skipped)."""
    from draccus.wrappers import docstring

    from qkvflow.runs import configfile
    from qkvflow.runs.config import TrainConfig

    monkeypatch.setattr(configfile, "_PARSERS", {})  # this test builds the parser
    configfile.memoise_field_docstrings()  # as `parse` does first; it then keeps the spy (already memoised)
    looked_up, lookup = [], docstring.get_attribute_docstring

    def spy(*args):
        looked_up.append(args)
        return lookup(*args)

    spy.cache_info = lookup.cache_info
    monkeypatch.setattr(docstring, "get_attribute_docstring", spy)
    config = configfile.parse(TrainConfig, ["--config_path", TINY, "--model.num_heads", "4"], "train")
    assert looked_up == [] and config.model.num_heads == 4
    assert docstring.get_attribute_docstring is spy  # restored when the build ended
    assert config == _fresh(TrainConfig, TINY, ["--model.num_heads", "4"])
    assert looked_up  # the fresh parser did look them up, through the module


def test_memoised_comments_are_draccus_own():
    """Every field of the run config's sections: the memoised lookup answers what draccus's own does."""
    from draccus.wrappers import docstring
    from levanter.trainer import TrainerConfig

    from qkvflow.integrate.config import OdeConfig
    from qkvflow.models.depth_dial import DepthDialConfig
    from qkvflow.models.diffeqformer import DiffEqFormerConfig
    from qkvflow.runs.config import TrainConfig
    from qkvflow.runs.configfile import memoise_field_docstrings

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

    from qkvflow.models.registry import only_named_types
    from qkvflow.runs.configfile import model_types

    with only_named_types(model_types(path, args)):
        return draccus.parse(cls, config_path=path, args=args)


def test_a_reused_parser_reads_each_parse_own_file_and_overrides():
    """Parses of one class share one parser: the second, of another file with other overrides, builds
    none and gives what a parser of its own gives, and the first parse's file and overrides do not leak."""
    from qkvflow.runs import configfile
    from qkvflow.runs.config import TrainConfig

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

    from qkvflow.models.diffeqformer import DiffEqFormerGpt2Config
    from qkvflow.runs import configfile
    from qkvflow.runs.config import TrainConfig

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

    from qkvflow.models.registry import only_named_types
    from qkvflow.runs import configfile
    from qkvflow.runs.config import TrainConfig

    LmConfig.get_known_choices()  # the search for every type, which a help parse would start
    configfile.parse(TrainConfig, ["--config_path", TINY], "train")
    capsys.readouterr()
    with pytest.raises(SystemExit):
        configfile.parse(TrainConfig, ["--config_path", TINY, "--help"], "train")
    shown = capsys.readouterr().out
    with only_named_types(None):
        ArgumentParser(config_class=TrainConfig, exit_on_error=True).parser.print_help()
    assert shown == capsys.readouterr().out and "[--trainer.seed int]" in shown
    assert "inner grid times" in shown  # a field comment (DepthDialConfig.jitter's): help keeps them
