"""Prompts in, completions out, on Levanter's `InferenceEngine` (paged KV cache, batched prefill and decode).

    generate(model, tokenizer, ["Once upon"], max_new_tokens=20, temperature=0.0)

What each option does:

* temperature: 0 is greedy (argmax); > 0 samples softmax(logits / temperature) (Levanter's `Sampler`).
* top_p: nucleus sampling (Levanter's `Sampler`); top_k: the k most likely tokens (`TopKSampler`).
* seed: request i samples with the key fold_in(PRNGKey(seed), i) (the engine folds in each position),
  so the same seed, prompts and options give the same text.
* stop_token_ids: generation ends at the first of these tokens; stop: at the first occurrence of
  any of these strings in the completion's text. Both are EXCLUDED from the returned completion
  (as OpenAI's API and Hugging Face's stop strings do) and `finish_reason` is "stop"; otherwise the
  completion ends after max_new_tokens and `finish_reason` is "length". Stop token ids and the
  stop strings' own tokenisations are given to the engine as stop sequences, so decoding usually
  ends there; the text search catches a stop string that was produced with other token boundaries.
* stream: a callback `stream(index, text)` receives each completion's new text as the engine
  returns tokens (every `max_rounds` decode rounds).

The engine holds `max_seqs` sequences at once; more prompts are decoded in successive batches.
Prompts are framed as training framed documents (`frame_prompt`: the tokenizer's bos, then the text).
Prompt (with its bos) + max_new_tokens must fit the model's context (`max_seq_len`): a longer one is refused.
"""

import dataclasses
from typing import Callable, NamedTuple, Optional, Sequence

import haliax as hax
import jax.numpy as jnp
import jax.random as jrandom
from levanter.inference.engine import InferenceEngine, InferenceEngineConfig, Request
from levanter.inference.jit_scheduler import SeqDecodingParams
from levanter.inference.utils import INVALID

from qkvflow.errors import UserError

from .decoders import decoder_for
from .sampling import TopKSampler


@dataclasses.dataclass(frozen=True)
class SamplingOptions:
    max_new_tokens: int = 32
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: Optional[int] = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    seed: int = 0

    def check(self) -> None:
        if isinstance(self.max_new_tokens, bool) or self.max_new_tokens < 1:
            raise UserError(f"max_new_tokens={self.max_new_tokens!r} is invalid: expected an integer >= 1")
        if not self.temperature >= 0:
            raise UserError(f"temperature={self.temperature!r} is invalid: expected a float >= 0 (0 = greedy)")
        if not 0 < self.top_p <= 1:
            raise UserError(f"top_p={self.top_p!r} is invalid: expected a float in (0, 1]")
        if self.top_k is not None and self.top_k < 1:
            raise UserError(f"top_k={self.top_k!r} is invalid: expected null or an integer >= 1")
        if any(s == "" for s in self.stop):
            raise UserError("stop='' is invalid: expected non-empty stop strings")


class Completion(NamedTuple):
    prompt: str
    text: str
    tokens: list[int]
    finish_reason: str
    """"stop" (a stop string or token ended it; not included) or "length" (max_new_tokens)."""


@dataclasses.dataclass(frozen=True)
class EngineSizes:
    """The engine's buffer sizes: small defaults fit a CPU; raise max_seqs for larger batches."""

    max_seqs: int = 8
    page_size: int = 16
    max_rounds: int = 8
    cache_dtype: str = "float32"
    """KV cache dtype; float32 keeps cached decoding equal to the uncached forward (bfloat16 is the engine's default)."""
    max_stop_seqs: int = 4
    max_stop_tokens: int = 8
    """Stop sequences the engine checks on device; longer or further ones are found in the text only."""


def frame_prompt(tokenizer, text: str) -> list[int]:
    """The ids of a prompt framed as training framed every document: Levanter's `BatchTokenizer` encodes a
    document as ``[bos] + encode(text + " " + eos)`` (bos when the tokenizer has one), so a prompt, the start
    of a document, is ``[bos] + encode(text)`` (no end marker). The tokenizer `qkvflow export` writes
    (`qkvflow.export.hf_folder.prompt_tokenizer`) gives the same ids for ``tokenizer(text)``."""
    ids = list(map(int, tokenizer(text, add_special_tokens=False)["input_ids"])) if text else []
    bos = getattr(tokenizer, "bos_token_id", None)
    return ([int(bos)] if bos is not None and ids else []) + ids


def encode_prompts(tokenizer, prompts: Sequence[str], context: int, max_new_tokens: int) -> list[list[int]]:
    """Each prompt's ids (`frame_prompt`); a prompt that is empty or too long for the context is refused."""
    ids = []
    for i, prompt in enumerate(prompts):
        tokens = frame_prompt(tokenizer, prompt)
        if not tokens:
            raise UserError(f"prompt {i + 1} is empty: expected text of at least one token")
        if len(tokens) + max_new_tokens > context:
            raise UserError(
                f"prompt {i + 1} has {len(tokens)} tokens and max_new_tokens={max_new_tokens}: together more than the "
                f"model's context max_seq_len={context}; shorten the prompt or lower max_new_tokens"
            )
        ids.append(tokens)
    return ids


def _stop_array(tokenizer, options: SamplingOptions, sizes: "EngineSizes"):
    """The stop sequences the engine checks: stop token ids first, then the stop strings' tokens."""
    seqs = [[int(t)] for t in options.stop_token_ids]
    for s in options.stop:
        seqs.append(list(map(int, tokenizer(s, add_special_tokens=False)["input_ids"])))
    seqs = [s for s in seqs if 0 < len(s) <= sizes.max_stop_tokens][: sizes.max_stop_seqs]
    if not seqs:
        return None
    width = sizes.max_stop_tokens
    rows = [[INVALID] * (width - len(s)) + s for s in seqs]  # right-aligned, as the engine compares tails
    return hax.named(jnp.asarray(rows, dtype=jnp.int32), ("stop_seq", "position"))


def finish(tokenizer, prompt: str, tokens: list[int], options: SamplingOptions) -> Completion:
    """Cut the completion at the first stop token or stop string (excluded)."""
    stops = set(options.stop_token_ids)
    reason = "length"
    for i, t in enumerate(tokens):
        if t in stops:
            tokens, reason = tokens[:i], "stop"
            break
    text = tokenizer.decode(tokens, skip_special_tokens=False)
    cut = [text.find(s) for s in options.stop if s in text]
    if cut:
        text, reason = text[: min(cut)], "stop"
    return Completion(prompt, text, tokens, reason)


def build_engine(decoder, tokenizer, sizes: EngineSizes, top_k: Optional[int] = None) -> InferenceEngine:
    """An engine for sequences up to the model's context; its shapes depend only on `decoder` and
    `sizes`, so engines built again for the same model reuse the compiled prefill and decode loop."""
    length = decoder.Pos.size
    rounds = min(sizes.max_rounds, length)
    length = -(-length // rounds) * rounds  # the engine runs max_seq_len // max_rounds decode calls
    config = InferenceEngineConfig(
        max_seq_len=length,
        page_size=sizes.page_size,
        max_rounds=rounds,
        max_seqs=sizes.max_seqs,
        max_pages=sizes.max_seqs * (-(-length // sizes.page_size)),
        compute_dtype=jnp.dtype(sizes.cache_dtype),
        max_stop_seqs=sizes.max_stop_seqs,
        max_stop_tokens=sizes.max_stop_tokens,
        max_queued_tokens=max(64, sizes.max_seqs),
        max_seqs_in_prefill=sizes.max_seqs,
        max_prefill_size=sizes.max_seqs * length,
    )
    engine = InferenceEngine.from_model_with_config(decoder, tokenizer, config)
    if top_k is not None:
        engine.sampler = TopKSampler(decoder.Vocab, top_k)
    return engine


def generate(
    model,
    tokenizer,
    prompts: Sequence[str],
    options: SamplingOptions = SamplingOptions(),
    *,
    steps: Optional[int] = None,
    sizes: EngineSizes = EngineSizes(),
    stream: Optional[Callable[[int, str], None]] = None,
    decoder=None,
) -> list[Completion]:
    """One completion per prompt. `model`: a DiffEqFormer (decoded on its fixed grid, or on `steps`
    N' steps), a discretised `ParallelLMHeadModel` or a Levanter Llama; `decoder` reuses one built by
    `qkvflow.inference.decoders.decoder_for`."""
    options.check()
    prompts = list(prompts)
    if not prompts:
        raise UserError("no prompts: expected at least one")
    decoder = decoder if decoder is not None else decoder_for(model, steps)
    context = decoder.Pos.size
    ids = encode_prompts(tokenizer, prompts, context, options.max_new_tokens)
    engine = build_engine(decoder, tokenizer, sizes, options.top_k)
    stop = _stop_array(tokenizer, options, sizes)
    base = jrandom.PRNGKey(options.seed)
    out: list[Completion] = []
    for start in range(0, len(prompts), sizes.max_seqs):
        batch = range(start, min(start + sizes.max_seqs, len(prompts)))
        requests = [
            Request(
                prompt_tokens=ids[i],
                request_id=i,
                decode_params=SeqDecodingParams(
                    max_num_tokens=jnp.array(len(ids[i]) + options.max_new_tokens, dtype=jnp.int32),
                    stop_tokens=stop,
                    temperature=jnp.array(options.temperature, dtype=jnp.float32),
                    top_p=jnp.array(options.top_p, dtype=jnp.float32),
                    key=jrandom.fold_in(base, i),
                ),
                n_generations=1,
            )
            for i in batch
        ]
        callback = _streamer(engine, tokenizer, batch, stream, options) if stream is not None else None
        result = engine.generate(requests, step_callback=callback)
        for i, tokens in zip(batch, result.tokens):
            tokens = [t for t in tokens if t != INVALID][: options.max_new_tokens]
            done = finish(tokenizer, prompts[i], tokens, options)
            if callback is not None:
                callback.flush(i, done.text)
            out.append(done)
    return out


class _streamer:
    """Engine `step_callback`: before each decode call, pass on the text decoded since the last one.
    It reads `engine.results` (the engine's per-request token lists, filled as tokens arrive). What it
    passes on is always a prefix of the final completion: the text is cut at a stop token or stop string
    as `finish` cuts it, and an ending that could still become a stop string is held back until it does
    not (or the completion ends)."""

    def __init__(self, engine, tokenizer, batch, stream, options: SamplingOptions):
        self.engine, self.tokenizer, self.stream = engine, tokenizer, stream
        self.stop_ids, self.stops = set(options.stop_token_ids), options.stop
        self.sent = {i: "" for i in batch}

    def __call__(self, iteration: int) -> None:
        for i in self.sent:
            result = self.engine.results.get(i, {}).get(0)
            if result is not None:
                tokens = list(result.token_list)
                tokens = tokens[: next((k for k, t in enumerate(tokens) if t in self.stop_ids), len(tokens))]
                self._send(i, self._settled(self.tokenizer.decode(tokens, skip_special_tokens=False)))

    def _settled(self, text: str) -> str:
        """`text` up to its first stop string, less an ending that is the start of a stop string."""
        cut = [text.find(s) for s in self.stops if s in text]
        if cut:
            return text[: min(cut)]
        held = max((k for s in self.stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
        return text[: len(text) - held]

    def _send(self, i: int, text: str) -> None:
        if text.startswith(self.sent[i]) and len(text) > len(self.sent[i]):
            self.stream(i, text[len(self.sent[i]) :])
            self.sent[i] = text

    def flush(self, i: int, final: str) -> None:
        """The rest of the final (stop-trimmed) text."""
        self._send(i, final)
