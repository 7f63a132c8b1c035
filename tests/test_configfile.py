"""qkvflow.configfile: what the one config reader adds to draccus (its memoised field comments)."""

import dataclasses

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
