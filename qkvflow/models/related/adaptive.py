"""The Depth-Adaptive Transformer's exits on the parallel GPT-2 model (Elbayad, Gu, Grave and Auli,
"Depth-Adaptive Transformer", ICLR 2020, Section 2.1-2.2): an output classifier after every block.

With the parallel blocks of `qkvflow.models.discrete` (x_n = x_{n-1} + o_proj(Attn(attn_norm(x_{n-1})))
+ mlp(mlp_norm(x_{n-1})), n = 1..N) the exit after block n predicts the next token from x_n:

    p_n(y_{t+1} | x_{<=t}) = softmax(W_n norm_n(x_n[t]))                n = 1..N

    exit_heads: tied     norm_n = the final norm, W_n = the shared unembedding, for every n
                         (the paper's "tied": one classifier for all exits)
                untied   exits n < N have their own LayerNorm norm_n and their own projection W_n
                         (V x d, no bias); exit N is the model's final norm and unembedding
                         (the paper's "untied": a classifier per exit)

The paper's blocks are post-norm, so its classifiers read a normalised state; ours are pre-norm, so
every exit has a norm before its projection: the shared final norm (tied) or its own (untied).

Training (`exit_training`, through `compute_next_token_loss`, which `qkvflow train` calls):

    aligned   L = (1/N) sum_n L_n,   L_n = the next-token cross-entropy at exit n, averaged over the
              weighted target tokens as Levanter averages it (`loss_weight` honoured). All tokens pass
              through all blocks (the paper's "aligned" training, its best).
    mixed     M exit sequences (`mixed_samples`): for sample m every token t draws an exit
              e_t ~ Uniform{1..N} (independently), the blocks above a token's exit copy its state up,
                  x_n[t] = x_{n-1}[t] if n > e_t else block_n(x_{n-1})[t],
              so upper blocks still attend to the copied state through their own keys and values, and
              the loss is the cross-entropy at exit e_t: L = (1/M) sum_m mean_t CE_{e_t}(x_N[t]).
              The draws: `jax.random.split(key, M)[m]` gives `jax.random.randint(., tokens' shape, 1, N+1)`.
              Without a key (evaluation) the loss is the aligned one.

The evaluation loss (`compute_next_token_loss(reduction=None)`, `qkvflow train`'s eval/loss, `qkvflow
eval`) is the aligned mean over exits in both modes.

Evaluation with exits (`exit_forward`): a token that exits at n keeps its state in every later block,
x_k = where(exited, x_{k-1}, block_k(x_{k-1})), and gets exit n's prediction. Under teacher forcing this
is what incremental decoding with the state copied up does: upper layers compute the exited token's
keys and values from the copied state. The exit decision is a function `rule(n, x_n, logits_n)` ->
bool per token (a confidence threshold: `qkvflow.evaluation.exits.confidence_threshold`; a halting
head closes over its own parameters); exit N always takes every token left.

`exit_states` returns x_1..x_N and `exit_logits` every exit's logits, all tokens through all blocks
(the per-exit evaluation, and the input of halting heads and their oracles).
"""

import dataclasses
from dataclasses import dataclass
from typing import Callable, NamedTuple, Optional

import equinox as eqx
import haliax as hax
import haliax.nn as hnn
import jax.numpy as jnp
import jax.random as jrandom
from haliax import Axis, NamedArray
from haliax.nn.scan import Stacked
from levanter.layers.attention import AttentionMask
from levanter.models.lm_model import LmExample
from levanter.models.loss import maybe_fused_next_token_loss

from qkvflow.errors import check as _check
from qkvflow.models.discrete.layers import make_norm
from qkvflow.models.discrete.model import ParallelGpt2Config, ParallelLMHeadModel, ParallelTransformer
from qkvflow.models.flavour import GPT2
from qkvflow.models.registry import register

EXIT_HEADS = ("tied", "untied")
EXIT_TRAINING = ("aligned", "mixed")

ExitRule = Callable[[int, NamedArray, NamedArray], NamedArray]
"""rule(n, x_n, logits_n) -> bool NamedArray over the tokens' axes: exit at n (n = 1..N-1)."""


@register("adaptive_gpt2", flavour=GPT2, ode=False)
@dataclass(frozen=True)
class AdaptiveGpt2Config(ParallelGpt2Config):
    """Parallel GPT-2 blocks with an output classifier after every block (the Depth-Adaptive
    Transformer's exits; see the module docstring). Only `block_scheme: euler`."""

    exit_heads: str = "tied"
    """`tied`: every exit is the final norm + the shared unembedding; `untied`: exits 1..N-1 have their own
    LayerNorm and projection to the vocabulary, exit N is the model's own."""
    exit_training: str = "aligned"
    """`aligned`: the mean over exits of each exit's loss; `mixed`: `mixed_samples` sampled exit sequences."""
    mixed_samples: int = 1
    """M, the number of exit sequences sampled per step in `mixed` training."""

    def __post_init__(self):
        super().__post_init__()
        _check(self.exit_heads in EXIT_HEADS, "exit_heads", self.exit_heads, f"one of {list(EXIT_HEADS)}")
        _check(
            self.exit_training in EXIT_TRAINING, "exit_training", self.exit_training, f"one of {list(EXIT_TRAINING)}"
        )
        _check(self.mixed_samples >= 1, "mixed_samples", self.mixed_samples, "an integer >= 1")
        _check(
            self.block_scheme == "euler",
            "block_scheme",
            self.block_scheme,
            "euler (exits on Runge-Kutta blocks are not built)",
        )

    Exits = property(lambda self: Axis("exits", self.num_layers - 1))
    """The untied exits before the last, 1..N-1."""

    @property
    def model_type(self):
        return AdaptiveLMHeadModel

    def flops_per_token(self, vocab_size: int, context_length: int) -> Optional[float]:
        """Training forward FLOPs per token: the blocks and one classifier (the parallel model's count)
        plus the other N-1 classifiers, 2 V d each (aligned; mixed: M forward passes, each with every
        classifier when untied and one when tied)."""
        base = super().flops_per_token(vocab_size, context_length)
        heads = 2.0 * vocab_size * self.hidden_dim * (self.num_layers - 1)
        if self.exit_training == "aligned":
            return base + heads
        return self.mixed_samples * (base + (heads if self.exit_heads == "untied" else 0.0))


class ExitHead(eqx.Module):
    """An untied exit's classifier: its own norm and its own projection to the vocabulary (no bias)."""

    norm: hnn.LayerNorm | hnn.RmsNorm
    proj: hnn.Linear  # embed -> vocab

    @staticmethod
    def init(config: AdaptiveGpt2Config, Vocab: Axis, *, key) -> "ExitHead":
        return ExitHead(make_norm(config), hnn.Linear.init(config.Embed, Vocab, key=key, use_bias=False))


class ExitOutput(NamedTuple):
    """What `exit_forward` returns."""

    logits: NamedArray
    """The logits of each token's exit, (batch..., position, vocab)."""
    exits: NamedArray
    """Each token's exit n in 1..N (int32, the tokens' axes)."""


class AdaptiveLMHeadModel(ParallelLMHeadModel):
    """The parallel LM with an exit after every block. `activations` and `get_lm_head` are the last
    exit's (the full-depth model); the exits are read with `exit_states`, `exit_logits`, `exit_forward`."""

    exit_heads: Optional[Stacked[ExitHead]] = None  # untied exits 1..N-1 over `exits`; None when tied or N = 1

    @classmethod
    def init(cls, Vocab: Axis, config: AdaptiveGpt2Config, *, key) -> "AdaptiveLMHeadModel":
        k_model, k_head, k_exits = jrandom.split(key, 3)
        lm_head = None
        if not config.tied_embeddings:
            lm_head = hnn.Linear.init(config.Embed, Vocab, key=k_head, use_bias=False)
        heads = None
        if config.exit_heads == "untied" and config.num_layers > 1:
            init = Stacked.init(config.Exits, ExitHead, gradient_checkpointing=False)
            heads = init(config, Vocab, key=jrandom.split(k_exits, config.num_layers - 1))
        return cls(ParallelTransformer.init(Vocab, config, key=k_model), lm_head, heads)

    @property
    def num_exits(self) -> int:
        return self.config.num_layers

    def exit_classifier(self, n: int) -> tuple[Callable[[NamedArray], NamedArray], NamedArray]:
        """(norm_n, W_n) of exit n (1-based): W_n with axes (vocab, embed) or (embed, vocab)."""
        if self.exit_heads is None or n == self.num_exits:
            return self.model.norm, self.get_lm_head()
        head = self.exit_heads.get_layer(n - 1)
        return head.norm, head.proj.weight

    def logits_at(self, n: int, x: NamedArray) -> NamedArray:
        """Exit n's logits W_n norm_n(x)."""
        norm, weight = self.exit_classifier(n)
        return hax.dot(norm(x), weight, axis=self.Embed)

    def _embed(self, input_ids, attn_mask, pos_ids):
        mask = AttentionMask.causal() if attn_mask is None else attn_mask
        x, pos_ids = self.model.embed(input_ids, pos_ids)
        return x, mask, pos_ids

    def exit_states(
        self,
        input_ids: NamedArray,
        attn_mask: Optional[AttentionMask | NamedArray] = None,
        *,
        pos_ids: Optional[NamedArray] = None,
        exits: Optional[NamedArray] = None,
    ) -> NamedArray:
        """x_1..x_N stacked over the `layers` axis (before the exits' norms), every token through every
        block; with `exits` (int per token, 1..N) a token's state is copied up above its exit."""
        x, mask, pos_ids = self._embed(input_ids, attn_mask, pos_ids)

        def step(block, carry, mask, pos_ids):
            x, n = carry  # n: how many blocks ran before this one
            y = block(x, mask, pos_ids)
            if exits is not None:
                y = hax.where(exits > n, y, x)
            return (y, n + 1), y

        _, states = self.model.layers.scan_via(step)((x, jnp.zeros((), jnp.int32)), mask, pos_ids)
        return states

    def exit_logits(self, input_ids, attn_mask=None, *, pos_ids=None) -> NamedArray:
        """Every exit's logits over the `layers` axis, all tokens through all blocks."""
        states = self.exit_states(input_ids, attn_mask, pos_ids=pos_ids)
        Layers = self.config.Layers
        return hax.stack(Layers, [self.logits_at(n, states[Layers, n - 1]) for n in range(1, self.num_exits + 1)])

    def exit_forward(
        self, input_ids: NamedArray, rule: ExitRule, attn_mask=None, *, pos_ids: Optional[NamedArray] = None
    ) -> ExitOutput:
        """Evaluation with exits and copy-up (module docstring): a token leaves at the first n with
        `rule(n, x_n, logits_n)` true (at N if none), and blocks above it keep its state."""
        x, mask, pos_ids = self._embed(input_ids, attn_mask, pos_ids)
        N = self.num_exits
        exited = hax.zeros(input_ids.axes, dtype=bool)
        exit_at = hax.full(input_ids.axes, N, dtype=jnp.int32)
        out = None
        for n, block in enumerate(self.model.layers.unstacked(), start=1):
            x = hax.where(exited, x, block(x, mask, pos_ids))
            logits = self.logits_at(n, x)
            new = ~exited if n == N else rule(n, x, logits) & ~exited
            out = logits if out is None else hax.where(new, logits, out)
            exit_at = hax.where(new, n, exit_at)
            exited = exited | new
        return ExitOutput(out, exit_at)

    # --- training ---------------------------------------------------------------------------------
    def compute_next_token_loss(
        self,
        example: LmExample,
        *,
        key=None,
        reduction: Optional[hax.ReductionFunction] = hax.mean,
        reduction_axis: Optional[hax.AxisSelection] = None,
        logsumexp_weight: Optional[float] = None,
        loss_dtype: Optional[jnp.dtype] = jnp.float32,
        logit_soft_cap: Optional[float] = None,
    ) -> jnp.ndarray | NamedArray:
        """The aligned loss, or with `exit_training: mixed` and a key the mixed loss (module docstring)."""
        config: AdaptiveGpt2Config = self.config
        common = dict(logsumexp_weight=logsumexp_weight, dtype=loss_dtype, logit_soft_cap=logit_soft_cap)

        def exit_loss(n, x, loss_weight, reduction, reduction_axis):
            norm, weight = self.exit_classifier(n)
            return maybe_fused_next_token_loss(
                self.Pos, self.Embed, self.Vocab, norm(x), weight, example.tokens,
                loss_weight=loss_weight, reduction=reduction, reduction_axis=reduction_axis, **common,
            )  # fmt: skip

        N, Layers = self.num_exits, config.Layers
        if config.exit_training == "aligned" or key is None:
            states = self.exit_states(example.tokens, example.attn_mask)
            losses = [
                exit_loss(n, states[Layers, n - 1], example.loss_weight, reduction, reduction_axis)
                for n in range(1, N + 1)
            ]
            return sum(losses[1:], losses[0]) / N

        # mixed: per sample, each token's loss at its own exit (unreduced, Levanter's weighting below)
        tokens = example.tokens
        per_token = None
        for k in jrandom.split(key, config.mixed_samples):
            exits = hax.named(jrandom.randint(k, tokens.array.shape, 1, N + 1), tokens.axes)
            x_top = self.exit_states(tokens, example.attn_mask, exits=exits)[Layers, N - 1]
            heads = [N] if config.exit_heads == "tied" or N == 1 else range(1, N + 1)
            chosen = sum(
                exit_loss(n, x_top, None, None, None) * (1.0 if len(heads) == 1 else (exits == n)) for n in heads
            )
            per_token = chosen if per_token is None else per_token + chosen
        per_token = per_token / config.mixed_samples
        # the weights Levanter's next-token loss uses: loss_weight, and not the last position (no target)
        Pos = tokens.resolve_axis(self.Pos.name)
        weight = hax.logical_not(hax.nn.one_hot(-1, Pos, dtype=jnp.bool_)).astype(jnp.float32)
        if example.loss_weight is not None:
            weight = weight * example.loss_weight.astype(jnp.float32)
        return hax.nn.loss.maybe_reduce_loss(per_token, reduction, reduction_axis, None, weight)

    def resize_vocab(self, new_size: int, key=None) -> "AdaptiveLMHeadModel":
        k_base, k_exits = jrandom.split(key if key is not None else jrandom.PRNGKey(0))
        resized = super().resize_vocab(new_size, k_base)
        heads = self.exit_heads
        if heads is not None:
            proj = heads.stacked.proj
            weight = hax.tree_util.resize_axis(proj.weight, self.Vocab.name, new_size, key=k_exits)
            proj = dataclasses.replace(proj, weight=weight, Out=self.Vocab.resize(new_size))
            heads = dataclasses.replace(heads, stacked=dataclasses.replace(heads.stacked, proj=proj))
        return dataclasses.replace(resized, exit_heads=heads)
