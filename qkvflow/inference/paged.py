"""Attention over a paged KV cache, as a drop-in for `qkvflow.models.fields.common.attend`.

One `PagedAttend` serves one "layer" (one vector-field evaluation of a fixed-step solve, or one
block of the discretised model) for one `decode` call: it writes the new tokens' keys and values
into that layer's `KvPageCache` (`KvPageCache.update`) and attends from the new queries over all
cached positions of their sequences with Levanter's `ragged_paged_attention` (causal,
scale 1/sqrt(head_size), as `attend`). This is what Levanter's own `Attention.paged_decode` does
after its projections; the projections stay the model's own, so cached and uncached decoding share
every other operation.

The hook records the updated cache in `self.cache`; it is called at trace time inside the model's
Python code (no `lax` loop between), so the attribute holds the traced value the caller then reads.
"""

import math

import haliax as hax
from haliax import NamedArray
from levanter.inference.page_table import PageBatchInfo
from levanter.layers.attention import ragged_paged_attention
from levanter.layers.kv_cache import KvPageCache

HEADS, KV_HEAD, GROUP = "heads", "kv_head", "q_heads_per_group"


class PagedAttend:
    """The attention step of a decoder with Levanter's paged key/value cache: appends this call's keys
    and values to `cache` (kept on the object for the caller to read back), then attends over them."""

    def __init__(self, cache: KvPageCache, batch_info: PageBatchInfo):
        self.cache = cache
        self.batch_info = batch_info

    def __call__(self, q: NamedArray, k: NamedArray, v: NamedArray, config, mask=None) -> NamedArray:
        """softmax(q k^T / sqrt(head_size)) v over each sequence's cached positions; `mask` is ignored
        (the paged kernel is causal by construction)."""
        Pos, HeadSize = config.max_Pos.name, config.HeadSize.name
        order = (Pos, KV_HEAD, HeadSize)  # KvPageCache.update reads the raw arrays as [tok, heads, dim]
        k = k.rename({HEADS: KV_HEAD}).rearrange(order)
        v = v.rename({HEADS: KV_HEAD}).rearrange(order)
        self.cache = self.cache.update(self.batch_info, k, v)
        q = q.rename({HEADS: KV_HEAD}).broadcast_axis(hax.Axis(GROUP, 1)).rearrange((Pos, KV_HEAD, GROUP, HeadSize))
        info = self.batch_info
        out = ragged_paged_attention(
            q,
            self.cache.kv_pages,
            info.seq_lens,
            info.page_indices,
            info.cu_q_lens,
            info.num_seqs,
            sm_scale=1.0 / math.sqrt(config.HeadSize.size),
        )
        return out[GROUP, 0].rename({KV_HEAD: HEADS})


def empty_cache(spec, config, dtype) -> KvPageCache:
    """One layer's empty cache: keys and values of every head (multi-head attention: kv heads = heads)."""
    return KvPageCache.init(spec, config.Heads, config.HeadSize, dtype=dtype)
