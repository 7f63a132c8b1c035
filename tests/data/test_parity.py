"""PARITY is exact: counts, every string once, labels are parities (reference built here by counting)."""

import numpy as np
import pytest

from qkvflow.data.parity import EQ, PAD, SOS, parity_dataset
from qkvflow.errors import UserError


@pytest.mark.parametrize("max_length,count", [(6, 126), (8, 510)])
def test_counts_and_labels(max_length, count):
    data = parity_dataset(max_length)
    assert data.tokens.shape == (count, max_length + 1)
    seen = set()
    for row, n, label, bits in zip(data.tokens, data.lengths, data.labels, data.bits):
        assert row[0] == SOS and n == bits + 1
        assert all(tok == PAD for tok in row[n:])
        string = "".join(str(t) for t in row[1:n])
        assert set(string) <= {"0", "1"} and len(string) == bits
        assert label == string.count("1") % 2
        seen.add(string)
    # every binary string of each length 1..max_length exactly once
    expected = {format(v, f"0{k}b") for k in range(1, max_length + 1) for v in range(2**k)}
    assert seen == expected and len(seen) == count
    assert np.bincount(data.labels).tolist() == [count // 2, count // 2]


def test_causal_rows_end_with_eq():
    data = parity_dataset(3, causal=True)
    for row, n in zip(data.tokens, data.lengths):
        assert row[0] == SOS and row[n - 1] == EQ and all(t in (0, 1) for t in row[1 : n - 1])


def test_bad_length():
    with pytest.raises(UserError, match="parity.max_length"):
        parity_dataset(0)
