"""lm-eval's `loglikelihood_rolling` (wikitext-style perplexity tasks) for Levanter's harness.

Levanter's `LevanterHarnessLM.loglikelihood_rolling` raises NotImplementedError. `RollingHarnessLM`
adds it with lm-eval's own window rules, as lm-eval's Hugging Face model applies them: a document's
tokens are cut by `lm_eval.utils.get_rolling_token_windows` (prefix token = the end-of-text token,
`context_len=1`), each window made disjoint by `lm_eval.utils.make_disjoint_window`, and the
document's log-likelihood is the sum over windows of

    sum_{j in pred} log p(token_j | context, pred_<j),   every window scored alone from position 0.

Each window becomes one Levanter `PromptCompletion` (ids = context + pred, prompt = context), packed
and scored by Levanter's own loglikelihood program (`leader.dispatch_loglikelihood`), which reads
the targets out of the packed ids and never scores the last position. A window of `max_seq_len`
predicted tokens therefore needs `max_seq_len + 1` ids, so the window length here is the model's
context minus one (`max_length` below); that is also the longest request Levanter's `loglikelihood`
scores without truncating.

`enabled()` makes Levanter's harness build this class for the duration of one run (its worker
constructs `LevanterHarnessLM` by its module-level name; nothing else is changed).
"""

from __future__ import annotations

import contextlib

import jax
import numpy as np
from levanter.data.loader import stack_batches
from levanter.data.packing import PromptCompletion, greedy_pack_prompt_completions
from levanter.eval_harness import LevanterHarnessLM
from levanter.utils.background_iterable import BackgroundIterator


def rolling_windows(tokens: list[int], prefix_token: int, max_seq_len: int) -> list[tuple[list[int], list[int]]]:
    """lm-eval's disjoint (context, predicted) windows of one document, as its Hugging Face model builds them."""
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window  # the optional `eval` extra

    return [
        make_disjoint_window(w)
        for w in get_rolling_token_windows(tokens, prefix_token=prefix_token, max_seq_len=max_seq_len, context_len=1)
    ]


class RollingHarnessLM(LevanterHarnessLM):
    """Levanter's harness model plus `loglikelihood_rolling` (the module docstring)."""

    @property
    def max_length(self) -> int:
        return self.EvalPos.size - 1

    def _pad_token(self) -> int:
        pad = self.tokenizer.pad_token_id
        return pad if pad is not None else self.eot_token_id

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        if self.prefix_token_id is None:
            raise ValueError("loglikelihood_rolling needs an end-of-text token to start each document")
        owner, windows = [], []
        for i, request in enumerate(requests):
            (text,) = request.args
            tokens = self.tokenizer.encode(text, add_special_tokens=False)
            for context, pred in rolling_windows(tokens, self.prefix_token_id, self.max_length):
                owner.append(i)
                windows.append(
                    PromptCompletion(ids=context + pred, prompt_length=len(context), segment_id=len(windows))
                )
        scores = np.zeros(len(windows))
        seen = np.zeros(len(windows), dtype=bool)
        packed = greedy_pack_prompt_completions(
            self.EvalPos, windows, pad_token=self._pad_token(), max_segments_per_example=self.leader.max_packed_segments
        )
        # stacked in a thread, as Levanter's `loglikelihood` does: stack_batches holds a CPU mesh
        # around each yield, which must not be current when the batch is dispatched to the model's mesh
        for batch in BackgroundIterator(stack_batches(iter(packed), self.EvalPos, self.EvalBatch), max_capacity=64):
            ids, lls, _ = (np.asarray(jax.device_get(a.array)) for a in self.leader.dispatch_loglikelihood(batch))
            valid = ids != -1  # the packer numbers segments by their index in `windows`; -1 is padding
            scores[ids[valid]] = lls[valid]
            seen[ids[valid]] = True
        if not seen.all():
            raise RuntimeError(f"loglikelihood_rolling: windows {np.flatnonzero(~seen)[:5].tolist()} were not scored")
        totals = np.zeros(len(requests))
        np.add.at(totals, np.asarray(owner, dtype=int), scores)
        return [float(x) for x in totals]


@contextlib.contextmanager
def enabled():
    """Levanter's harness builds `RollingHarnessLM` inside this block."""
    import levanter.eval_harness as eh

    original = eh.LevanterHarnessLM
    eh.LevanterHarnessLM = RollingHarnessLM
    try:
        yield
    finally:
        eh.LevanterHarnessLM = original
