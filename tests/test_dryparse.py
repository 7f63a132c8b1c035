"""qkvflow.cli.startup.dryparse, which tests/test_docs.py checks every documented command line with: what it lets
through must be what the verb accepts."""

import pytest

from qkvflow.cli.startup.dryparse import parse_only
from qkvflow.errors import UserError


def test_a_verb_without_a_config_path_refuses_a_stray_flag():
    """`plan` reads its config from the leftovers of its own parser; with no --config_path those leftovers
    cannot be config overrides, so a stray flag is refused, as the verb itself would, not passed over."""
    namespace, config = parse_only(["plan", "--target", "H100-80GB"])
    assert namespace.target == "H100-80GB" and config is None
    for stray in (["--bogus", "1"], ["--trainer.num_train_steps", "3"]):
        with pytest.raises(UserError) as error:
            parse_only(["plan", "--target", "H100-80GB", *stray])
        assert str(error.value) == f"qkvflow plan: error: unrecognized arguments: {' '.join(stray)}"
