"""The PARITY task of the N-ODE Transformer (Baier-Reinio & De Sterck, 2020, sec. 4).

Every binary string of length 1..max_length (2 + 4 + ... + 2^max_length = 2^(max_length+1) - 2
strings: 126 for max_length 6, 510 for 8); the label is the parity (number of ones mod 2). The paper
trains on all of them and reports training accuracy.

Tokens: 0 and 1 are the bits, `SOS` starts every string (the readout state), `EQ` ('=') ends the
input of the causal-LM adaptation, `PAD` fills to a fixed length (masked out of attention).
"""

import itertools
from typing import NamedTuple

import numpy as np

from qkvflow.errors import check

SOS, EQ, PAD = 2, 3, 4
VOCAB = 5


class ParityData(NamedTuple):
    """Padded arrays for all strings: `tokens` [n, width], `lengths` [n] (real tokens, SOS included),
    `labels` [n] (parity of the bits), `bits` [n] (string length L)."""

    tokens: np.ndarray
    lengths: np.ndarray
    labels: np.ndarray
    bits: np.ndarray


def strings(max_length: int) -> list[tuple[int, ...]]:
    """All binary strings of length 1..max_length, shortest first, each length in lexicographic order."""
    check(isinstance(max_length, int) and 1 <= max_length <= 16, "parity.max_length", max_length, "an int in 1..16")
    return [s for n in range(1, max_length + 1) for s in itertools.product((0, 1), repeat=n)]


def parity_dataset(max_length: int, causal: bool = False) -> ParityData:
    """`SOS b1..bL` (encoder, the paper's input) or `SOS b1..bL =` (causal-LM adaptation), padded
    with PAD to the longest string."""
    all_strings = strings(max_length)
    extra = 2 if causal else 1
    width = max_length + extra
    tokens = np.full((len(all_strings), width), PAD, np.int32)
    for i, s in enumerate(all_strings):
        row = [SOS, *s, EQ] if causal else [SOS, *s]
        tokens[i, : len(row)] = row
    bits = np.array([len(s) for s in all_strings], np.int32)
    labels = np.array([sum(s) % 2 for s in all_strings], np.int32)
    return ParityData(tokens, bits + extra, labels, bits)
