"""qkvflow.bench.comparison.lr_grid directly: the choice by the mean over seeds, the grid's edge, and the next rate."""

import pytest

from qkvflow.bench.comparison.lr_grid import beyond, choose, edge


def test_the_choice_is_the_lowest_mean_over_the_seeds_not_one_seeds():
    """1e-3 is better on seed 0 (2.0 against 2.1) but worse on the mean ((2.0 + 3.0) / 2 = 2.5 against
    (2.1 + 2.2) / 2 = 2.15); on equal means the first rate of the grid wins."""
    assert choose({1e-3: [2.0, 3.0], 2e-3: [2.1, 2.2]}) == 2e-3
    assert choose({2e-3: [2.1, 2.2], 1e-3: [2.0, 3.0]}) == 2e-3
    assert choose({1e-3: [2.0, 2.5], 2e-3: [2.5, 2.0]}) == 1e-3  # a tie: the first
    assert choose({2e-3: [2.5, 2.0], 1e-3: [2.0, 2.5]}) == 2e-3


@pytest.mark.parametrize(
    "best, grid, want",
    [
        (1e-3, [1e-3, 2e-3, 4e-3], "lowest"),
        (4e-3, [1e-3, 2e-3, 4e-3], "highest"),
        (2e-3, [1e-3, 2e-3, 4e-3], None),
        (1e-3, [2e-3, 1e-3], "lowest"),  # the grid's order does not matter
        (1e-3, [1e-3], None),  # one rate: no edge to speak of
        (1e-3, [1e-3, 1e-3], None),  # nor one rate twice
    ],
)
def test_the_edge_of_a_grid(best, grid, want):
    assert edge(best, grid) == want


def test_the_next_rate_is_half_the_lowest_or_twice_the_highest_and_stays_below_1():
    assert beyond([1e-3, 2e-3], "lowest") == 5e-4
    assert beyond([1e-3, 2e-3], "highest") == 4e-3
    assert beyond([0.1, 0.4], "highest") == 0.8
    assert beyond([0.25, 0.5], "highest") is None  # 1.0: not below 1
    assert beyond([0.3, 0.6], "highest") is None  # 1.2
    assert beyond([0.6, 0.9], "lowest") == 0.3
