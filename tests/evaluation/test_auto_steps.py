"""`--steps auto`'s rule (qkvflow.evaluation.auto_steps): the fewest vector-field evaluations among the
grids whose loss is within the tolerance of the lowest; the expected choices are worked out by hand."""

import math
import re

import pytest

from qkvflow.errors import UserError
from qkvflow.evaluation import auto_steps


def rows(*pairs, solver="euler"):
    return [{"solver": solver, "steps": nfe, "nfe": nfe, "loss": loss} for nfe, loss in pairs]


# a resolved flow: the loss falls with the grid and converges (the finest grid is the best)
RESOLVED = rows((1, 3.000), (2, 2.520), (4, 2.505), (8, 2.501), (16, 2.500))
# a model bound to its training grid N = 4: finer and coarser grids are both worse
GRID_BOUND = rows((1, 3.000), (2, 2.800), (4, 2.400), (8, 2.450), (16, 2.600))


@pytest.mark.parametrize(
    "table, tolerance, chosen, best",
    [
        (RESOLVED, 0.01, 2, 4),  # 2.505 <= 2.500 + 0.01; 2.520 is not
        (RESOLVED, 0.02, 1, 4),  # 2.520 <= 2.520: the bound is inclusive
        (RESOLVED, 0.0, 4, 4),  # no tolerance: the lowest loss
        (RESOLVED, 1.0, 0, 4),  # any loss: the cheapest grid
        (GRID_BOUND, 0.01, 2, 2),  # the trained grid, not the finest
        (GRID_BOUND, 0.05, 2, 2),  # 8 steps (2.450) is within 0.05 but costs more
        (GRID_BOUND, 0.4, 1, 2),  # 2.800 <= 2.400 + 0.4
    ],
)
def test_the_fewest_evaluations_within_the_tolerance_of_the_lowest_loss(table, tolerance, chosen, best):
    assert auto_steps.choose(table, tolerance) == (chosen, best)


def test_equal_evaluations_go_to_the_lower_loss_and_failed_grids_are_skipped():
    # Heun at 2 steps and Euler at 4 both take 4 evaluations (qkvflow.integrate.solvers.evaluations)
    table = rows((4, 2.51)) + rows((4, 2.50), solver="heun") + rows((8, math.nan), (16, 2.49))
    assert auto_steps.choose(table, 0.05) == (1, 3)
    with pytest.raises(UserError, match="every candidate grid gave a non-finite loss"):
        auto_steps.choose(rows((1, math.nan), (2, math.inf)), 0.01)


@pytest.mark.parametrize("bad", [-0.01, math.nan, math.inf])
def test_a_bad_tolerance_is_refused(bad):
    with pytest.raises(UserError, match="--auto_tolerance .* is invalid: expected a number of nats >= 0"):
        auto_steps.choose(RESOLVED, bad)


def test_the_summary_names_the_choice_and_the_reference():
    assert auto_steps.summary(RESOLVED, 2, 4, 0.01) == (
        "steps auto: euler N=4 (4 vector-field evaluations, loss 2.5050), the fewest evaluations within 0.01 "
        "nats of the lowest loss (euler N=16: 2.5000, 16 evaluations)"
    )
    assert auto_steps.summary(GRID_BOUND, 2, 2, 0.01).endswith("of the lowest loss (its own)")


def test_candidates_default_to_the_whole_multiples_of_n():
    assert auto_steps.candidates(auto_steps.GRIDS, 4) == [1, 2, 4, 8, 16]
    assert auto_steps.candidates(auto_steps.GRIDS, 2) == [1, 2, 4, 8]  # N/4 is not a whole number of steps
    assert auto_steps.candidates(auto_steps.GRIDS, 3) == [3, 6, 12]
    assert auto_steps.candidates("1, 2N", 3) == [1, 6]
    with pytest.raises(UserError, match="--auto_grids N/4 is invalid with the trained N=2"):
        auto_steps.candidates("N/4,N", 2)  # given explicitly, every grid must exist
    with pytest.raises(UserError, match="--auto_grids 0 is invalid"):
        auto_steps.candidates("0,2", 2)


def test_defaults_are_pinned():
    from qkvflow.cli.eval import EvalOptions
    from qkvflow.cli.generate import GenerateOptions

    assert (auto_steps.GRIDS, auto_steps.TOLERANCE) == ("N/4,N/2,N,2N,4N", 0.01)
    for options in (EvalOptions(), GenerateOptions()):
        assert (options.steps, options.auto_grids, options.auto_tolerance, options.auto_split) == (
            None,
            "N/4,N/2,N,2N,4N",
            0.01,
            None,
        )


def test_the_auto_options_are_checked_before_any_work():
    """qkvflow.evaluation.auto_steps.check_auto, shared by eval and generate."""
    from types import SimpleNamespace

    from qkvflow.evaluation.auto_steps import check_auto

    def options(steps="auto", grids=auto_steps.GRIDS, tolerance=auto_steps.TOLERANCE, split=None, corpus=True):
        corpus = SimpleNamespace(eval_split="validation") if corpus else None
        return SimpleNamespace(steps=steps, auto_grids=grids, auto_tolerance=tolerance, auto_split=split, corpus=corpus)

    check_auto(options())
    check_auto(options(split="selection"))
    check_auto(options(steps=None))
    for bad, message in [
        (options(steps="4", grids="1,2"), "--auto_grids: only with --steps auto"),
        (options(steps=None, tolerance=0.1, split="test"), "--auto_tolerance and --auto_split: only with --steps auto"),
        (options(tolerance=-1.0), "--auto_tolerance -1.0 is invalid"),
        (options(split="train"), "--auto_split 'train' is invalid: expected one of validation, selection, test"),
        (options(split="test", corpus=False), "--auto_split test: needs a corpus: section"),
    ]:
        with pytest.raises(UserError, match=re.escape(message)):
            check_auto(bad)
