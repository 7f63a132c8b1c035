"""One sequence through a decoder's `decode`, token by token, outside the engine's scheduling loop.

`CachedStepper` keeps one sequence's paged KV cache with Levanter's `PageTable` and `DecodeState`
(the page allocation the engine uses: `DecodeState.allocate_for_seq` gives the `PageBatchInfo` of
each call) and returns the logits of every call. It is what the tests compare with the uncached
forward, step by step, and what `benchmarks/decode.py` times without the engine's sampling and
bookkeeping. Each call has its own shape (prefill: the prompt; then one token), so each shape
compiles once.
"""

import equinox as eqx
import haliax as hax
import jax.numpy as jnp
from levanter.inference.jit_scheduler import DecodeState
from levanter.inference.page_table import PageTable

SLOT = 0


@eqx.filter_jit
def _decode(decoder, cache, state: DecodeState, tokens, pos_ids):
    slots = hax.full_like(pos_ids, SLOT)
    state, info = state.allocate_for_seq(token_slot_ids=slots, token_pos_ids=pos_ids)
    logits, cache = decoder.decode(tokens, cache, info, pos_ids)
    return logits, cache, state


class CachedStepper:
    """One sequence decoded incrementally through a decoder's `decode` and a one-slot paged cache: each
    call appends tokens and returns their logits (the cached path that tests compare with full logits)."""

    def __init__(self, decoder, max_len: int, *, page_size: int = 8, dtype=jnp.float32):
        pages = -(-max_len // page_size)
        table = PageTable.init(pages, 1, page_size, pages)
        self.decoder = decoder
        self.cache = decoder.initial_cache(table.spec(), dtype=dtype)
        self.state, _ = DecodeState.init(table, max_stop_seqs=0, max_stop_tokens=0).reserve_slot(SLOT)
        self.length = 0

    def __call__(self, tokens: list[int]) -> hax.NamedArray:
        """Append `tokens` to the sequence; their logits, [position, vocab]."""
        Pos = hax.Axis("position", len(tokens))
        ids = hax.named(jnp.asarray(tokens, dtype=jnp.int32), Pos)
        pos_ids = hax.arange(Pos, start=self.length, dtype=jnp.int32)
        logits, self.cache, self.state = _decode(self.decoder, self.cache, self.state, ids, pos_ids)
        self.length += len(tokens)
        return logits
