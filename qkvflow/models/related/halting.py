"""Halting for the Depth-Adaptive Transformer (Elbayad, Gu, Grave & Auli, ICLR 2020): per token, after
which of the N exits (one output classifier after every block) to stop.

Exits are numbered n = 1..N in the equations; in code an exit is its 0-based index n - 1 along the
`Exit` axis. h_n is a token's state at exit n (the state the exit's classifier reads).

**Geometric-like halting.** One test per exit, a logistic unit on that exit's state:

    chi_n = sigmoid(w . h_n + b)
    q(n)  = chi_n * prod_{n' < n} (1 - chi_n')      n < N
    q(N)  = prod_{n' < N} (1 - chi_n')              (the remaining mass; chi_N is never used)

computed in log space (log q(n) = log sigmoid(z_n) + sum_{n'<n} log sigmoid(-z_n'), z = w . h + b).
At evaluation a token stops at the first n with chi_n > tau (tau = 0.5), or at N. A test costs
2 d FLOPs (a dot product of length d and the bias), one per exit reached below N.

**Multinomial halting.** One softmax over the N exits from the first block's state:
q = softmax(W h_1 + b); at evaluation a token stops at argmax_n q(n) (2 d N FLOPs, once per token).

**Oracles** (the training target n*, per token t). With S_t^n a per-exit score of the token,

    likelihood:   S_t^n = LL_t^n = log p_n(y_t | y_<t)      (the gold next token under exit n)
    correctness:  S_t^n = C_t^n  = 1[argmax_v p_n(v | y_<t) = y_t]

both smoothed over the token's neighbours with an RBF kernel over positions,

    S~_t^n = sum_{t'} kappa(t, t') m_t' S_t'^n / sum_{t'} kappa(t, t') m_t',   kappa(t, t') = exp(-(t - t')^2 / sigma)

(m the loss weight: positions without a target, e.g. the last one, neither count nor receive weight),
and n*_t = argmax_n (S~_t^n - lambda n), ties to the earliest exit. The paper writes the smoothing
as the sum sum_{t'} kappa(t, t') S_t'^n with kappa(t, t') = exp(-|t - t'|^2 / sigma) (from our reading
of the paper; sigma = 1 there). Here the sum is divided by the kernel mass of the positions that
exist, so S~ stays in the units of S (a weighted mean) and lambda means the same at the sequence edges
as in the middle; the paper's unnormalised sum would scale lambda by about 1.77 / 1.39 between the
middle and the ends of a sequence at sigma = 1. The kernel is symmetric: the target of token t reads
the scores of later tokens. That is legitimate for a training target (the halting head itself only
sees h_t, which is causal); the decisions at evaluation never read an oracle.

**Halting loss.** alpha * CE(delta(n*), q) = -alpha log q(n*), averaged over loss-weighted tokens.
The paper trains the halting heads after the exits ("aligned" training), with the trunk and the exit
classifiers frozen: the states h_n reach the head through stop_gradient.
"""

import dataclasses
from dataclasses import dataclass
from typing import Optional

import equinox as eqx
import haliax as hax
import haliax.nn as hnn
import jax
import jax.numpy as jnp
import jax.random as jrandom
from haliax import Axis, NamedArray
from levanter.models.lm_model import LmExample
from levanter.models.loss import next_token_loss

from qkvflow.errors import check
from qkvflow.models.flavour import GPT2
from qkvflow.models.registry import register
from qkvflow.models.related.adaptive import AdaptiveGpt2Config, AdaptiveLMHeadModel, ExitOutput

KINDS = ("none", "geometric", "multinomial")
ORACLES = ("likelihood", "correctness")


@dataclass(frozen=True)
class HaltingConfig:
    """Which halting mechanism, which oracle it is trained towards, and its constants (module docstring)."""

    kind: str = "none"
    """none (no halting head), geometric (a test per exit) or multinomial (one softmax from h_1)."""
    oracle: str = "correctness"
    """likelihood or correctness: the score the target exit n* maximises, less lambda n."""
    lam: float = 0.1
    """lambda: the price of one more exit, in units of the (smoothed) oracle score per token."""
    sigma: float = 1.0
    """Width of the smoothing kernel exp(-(t - t')^2 / sigma) over positions (paper: 1)."""
    alpha: float = 1.0
    """Weight of the halting loss."""
    tau: float = 0.5
    """Geometric halting: stop at the first exit with chi_n > tau."""

    def __post_init__(self):
        check(self.kind in KINDS, "halting.kind", self.kind, f"one of {list(KINDS)}")
        check(self.oracle in ORACLES, "halting.oracle", self.oracle, f"one of {list(ORACLES)}")
        check(self.lam >= 0, "halting.lam", self.lam, "a float >= 0")
        check(self.sigma > 0, "halting.sigma", self.sigma, "a float > 0")
        check(self.alpha > 0, "halting.alpha", self.alpha, "a float > 0")
        check(0 < self.tau < 1, "halting.tau", self.tau, "a float in (0, 1)")


# --- the two halting distributions ------------------------------------------------------------


def geometric_log_q(scores: NamedArray, Exit: Axis) -> NamedArray:
    """log q(n) of geometric-like halting from the test logits z_n = w . h_n + b (any other axes kept)."""
    last = hax.arange(Exit) == Exit.size - 1
    stay = hnn.log_sigmoid(-scores)  # log(1 - chi_n)
    before = hax.cumsum(stay, Exit) - stay  # sum_{n' < n} log(1 - chi_n')
    return before + hax.where(last, 0.0, hnn.log_sigmoid(scores))


def geometric_exit(scores: NamedArray, Exit: Axis, tau: float) -> NamedArray:
    """The 0-based exit of geometric halting: the first n with chi_n > tau, else the last one."""
    check(0 < tau < 1, "halting.tau", tau, "a float in (0, 1)")
    stops = (hnn.sigmoid(scores) > tau) | (hax.arange(Exit) == Exit.size - 1)
    return hax.argmax(stops, Exit)


def multinomial_log_q(logits: NamedArray, Exit: Axis) -> NamedArray:
    """log q(n) of multinomial halting: log softmax over the exits."""
    return hnn.log_softmax(logits, axis=Exit)


def multinomial_exit(logits: NamedArray, Exit: Axis) -> NamedArray:
    """The 0-based exit of multinomial halting: argmax_n q(n), ties to the earliest exit."""
    return hax.argmax(logits, Exit)


# --- oracles ----------------------------------------------------------------------------------


def gold_log_likelihood(logits: NamedArray, Vocab: Axis, targets: NamedArray) -> NamedArray:
    """LL = log p(y | .) of the gold tokens `targets` under `logits` (the Vocab axis is reduced)."""
    log_p = hnn.log_softmax(logits.astype(jnp.float32), axis=Vocab)
    return hax.sum(log_p * hnn.one_hot(targets, Vocab, dtype=log_p.dtype), Vocab)


def gold_correct(logits: NamedArray, Vocab: Axis, targets: NamedArray) -> NamedArray:
    """C = 1 where the argmax token of `logits` is the gold token, else 0 (float32)."""
    return (hax.argmax(logits, Vocab) == targets).astype(jnp.float32)


def smooth_over_positions(
    scores: NamedArray, Pos: Axis, sigma: float, weight: Optional[NamedArray] = None
) -> NamedArray:
    """S~_t = sum_t' kappa(t, t') m_t' S_t' / sum_t' kappa(t, t') m_t', kappa = exp(-(t - t')^2 / sigma).

    `weight` (m, over Pos and possibly batch axes; default all ones) removes positions from the sums;
    where no position of a sequence has weight, the result is 0.
    """
    check(sigma > 0, "halting.sigma", sigma, "a float > 0")
    Src = Pos.alias(Pos.name + "_src")
    t = jnp.arange(Pos.size, dtype=jnp.float32)
    kernel = hax.named(jnp.exp(-((t[:, None] - t[None, :]) ** 2) / sigma), (Pos, Src))
    m = hax.ones(Pos) if weight is None else weight.astype(jnp.float32)
    m = m.rename({Pos.name: Src.name})
    numerator = hax.dot(kernel, m * scores.astype(jnp.float32).rename({Pos.name: Src.name}), axis=Src)
    denominator = hax.dot(kernel, m, axis=Src)
    smoothed = hax.where(denominator > 0, numerator / hax.where(denominator > 0, denominator, 1.0), 0.0)
    return smoothed.rearrange((*scores.axes, ...))


def oracle_exit(
    scores: NamedArray,
    Exit: Axis,
    Pos: Axis,
    *,
    lam: float,
    sigma: float,
    weight: Optional[NamedArray] = None,
) -> NamedArray:
    """n* (0-based) = argmax_n (S~^n - lambda n) per token, ties to the earliest exit.

    `scores` holds S (LL or C) over Exit, Pos and any batch axes; `weight` is the loss weight m.
    """
    check(lam >= 0, "halting.lam", lam, "a float >= 0")
    smoothed = smooth_over_positions(scores, Pos, sigma, weight)
    return hax.argmax(smoothed - lam * (hax.arange(Exit) + 1).astype(jnp.float32), Exit)


# --- the loss and the cost ----------------------------------------------------------------------


def halting_loss(
    log_q: NamedArray, target: NamedArray, Exit: Axis, *, alpha: float, weight: Optional[NamedArray] = None
) -> NamedArray:
    """alpha * mean over weighted tokens of CE(delta(n*), q) = -log q(n*) (a scalar NamedArray)."""
    nll = -hax.sum(log_q * hnn.one_hot(target, Exit, dtype=log_q.dtype), Exit)
    m = hax.ones_like(nll) if weight is None else weight.astype(nll.dtype)
    return alpha * hax.sum(m * nll) / hax.maximum(hax.sum(m), 1e-12)


# --- the head ----------------------------------------------------------------------------------


class HaltingHead(eqx.Module):
    """The halting parameters: (w, b) of geometric halting, or (W, b) of multinomial halting.

    `log_q(states)` and `exit(states)` take the states h_n of every exit (an `Exit` axis and an `Embed`
    axis, any others kept); multinomial halting reads only h_1.
    """

    kind: str = eqx.field(static=True)
    Exit: Axis = eqx.field(static=True)
    proj: hnn.Linear  # Embed -> (); geometric: one logit per exit; multinomial: Embed -> Exit from h_1

    @staticmethod
    def init(kind: str, Exit: Axis, Embed: Axis, *, key, init_scale: float = 0.02) -> "HaltingHead":
        check(kind in ("geometric", "multinomial"), "halting.kind", kind, "geometric or multinomial")
        Out = Axis("halt", 1) if kind == "geometric" else Exit
        proj = hnn.Linear.init(Embed, Out, key=key, use_bias=True, out_first=True)
        weight = init_scale * jrandom.normal(key, proj.weight.array.shape)
        proj = eqx.tree_at(lambda p: p.weight.array, proj, weight)
        proj = eqx.tree_at(lambda p: p.bias.array, proj, jnp.zeros_like(proj.bias.array))
        return HaltingHead(kind, Exit, proj)

    def test_logit(self, h: NamedArray) -> NamedArray:
        """Geometric: z = w . h + b of one exit's state h (no `Exit` axis)."""
        return self.proj(h)["halt", 0]

    def logits(self, states: NamedArray) -> NamedArray:
        """Geometric: z_n = w . h_n + b over Exit. Multinomial: W h_1 + b over Exit."""
        if self.kind == "geometric":
            return self.test_logit(states)
        return self.proj(states[self.Exit.name, 0])

    def log_q(self, states: NamedArray) -> NamedArray:
        z = self.logits(states)
        return geometric_log_q(z, self.Exit) if self.kind == "geometric" else multinomial_log_q(z, self.Exit)

    def exit(self, states: NamedArray, tau: float = 0.5) -> NamedArray:
        """The 0-based exit of every token (geometric: first chi_n > tau; multinomial: argmax)."""
        z = self.logits(states)
        return geometric_exit(z, self.Exit, tau) if self.kind == "geometric" else multinomial_exit(z, self.Exit)


# --- the family: the exits model with a halting head --------------------------------------------


@register("halting_gpt2", flavour=GPT2, ode=False)
@dataclass(frozen=True)
class HaltingGpt2Config(AdaptiveGpt2Config):
    """The exits model of `qkvflow.models.related.adaptive` with a halting head (`halting:`, module docstring).

    With `halting.kind: none` it is `adaptive_gpt2`. Otherwise `qkvflow train` runs the halting phase:
    `trainer.initialize_from` names the aligned `adaptive_gpt2` checkpoint of the same shape, whose
    trunk and exits are loaded and frozen (`qkvflow.training.halting_phase`); only the head trains."""

    halting: HaltingConfig = dataclasses.field(default_factory=HaltingConfig)

    @property
    def model_type(self):
        return HaltingLMHeadModel

    def exits_config(self) -> AdaptiveGpt2Config:
        """The `adaptive_gpt2` config of the trunk and exits (what the aligned checkpoint holds)."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(AdaptiveGpt2Config)}
        return AdaptiveGpt2Config(**fields)


class HaltingLMHeadModel(AdaptiveLMHeadModel):
    """`AdaptiveLMHeadModel` plus `halting_head` (None for `halting.kind: none`).

    The head reads h_n = norm_n(x_n), the normalised state exit n's classifier reads. Training
    (a key given) with a head is the halting loss against the oracle, the trunk and exits under
    stop_gradient; evaluation (no key) is the next-token loss of each token at its halting exit, with
    the exits model's copy-up (`exit_forward`)."""

    halting_head: Optional[HaltingHead] = None

    @classmethod
    def init(cls, Vocab: Axis, config: HaltingGpt2Config, *, key) -> "HaltingLMHeadModel":
        model = super().init(Vocab, config, key=key)  # the trunk and exits as adaptive_gpt2 builds them
        if config.halting.kind == "none":
            return model
        head = HaltingHead.init(config.halting.kind, config.Layers, config.Embed, key=jrandom.fold_in(key, 7))
        return dataclasses.replace(model, halting_head=head)

    @classmethod
    def from_exits_model(cls, exits_model: AdaptiveLMHeadModel, config: HaltingGpt2Config, *, key):
        """This model with `exits_model`'s trunk and exits (e.g. a loaded aligned checkpoint) and a new head."""
        model = cls.init(exits_model.Vocab, config, key=key)
        trunk = dataclasses.replace(exits_model.model, config=config)  # `config` is read from the trunk
        return dataclasses.replace(model, model=trunk, lm_head=exits_model.lm_head, exit_heads=exits_model.exit_heads)

    def halting_states(self, states: NamedArray) -> NamedArray:
        """h_n = norm_n(x_n) over the `layers` axis, from `exit_states`' x_1..x_N."""
        Layers = self.config.Layers
        return hax.stack(
            Layers, [self.exit_classifier(n)[0](states[Layers, n - 1]) for n in range(1, self.num_exits + 1)]
        )

    def oracle(self, tokens: NamedArray, states: NamedArray, weight: NamedArray) -> NamedArray:
        """n* (0-based) of every token from the exits' logits (all tokens through all blocks)."""
        h, Layers = self.config.halting, self.config.Layers
        logits = hax.stack(Layers, [self.logits_at(n, states[Layers, n - 1]) for n in range(1, self.num_exits + 1)])
        targets = hax.roll(tokens, -1, self.Pos.name)
        score = gold_log_likelihood if h.oracle == "likelihood" else gold_correct
        return oracle_exit(
            score(logits, self.Vocab, targets), Layers, self.Pos, lam=h.lam, sigma=h.sigma, weight=weight
        )

    def halting_rule(self, input_ids: NamedArray, attn_mask=None, *, pos_ids=None):
        """The head's exit rule for `exit_forward` (`qkvflow.models.related.adaptive.ExitRule`): geometric, chi_n > tau
        on the copy-up state; multinomial, n = argmax q from h_1 (which copy-up does not change: no
        token has left before block 1), computed here from `input_ids`."""
        h = self.config.halting
        if h.kind == "geometric":
            return lambda n, x, logits: hnn.sigmoid(self.halting_head.test_logit(self.exit_classifier(n)[0](x))) > h.tau
        x0, mask, pos = self._embed(input_ids, attn_mask, pos_ids)
        x1 = self.model.layers.unstacked()[0](x0, mask, pos)
        choice = hax.argmax(self.halting_head.proj(self.exit_classifier(1)[0](x1)), self.config.Layers)
        return lambda n, x, logits: choice == n - 1

    def halting_exits(self, input_ids: NamedArray, attn_mask=None, *, pos_ids=None) -> ExitOutput:
        """Evaluation with the head's decisions and copy-up: each token's exit (1..N) and its logits there."""
        rule = self.halting_rule(input_ids, attn_mask, pos_ids=pos_ids)
        return self.exit_forward(input_ids, rule, attn_mask, pos_ids=pos_ids)

    def compute_next_token_loss(self, example: LmExample, *, key=None, reduction=hax.mean, reduction_axis=None, **kw):
        """The halting loss (training, a key given) or the halted model's next-token loss (evaluation);
        `adaptive_gpt2`'s losses when there is no head."""
        if self.halting_head is None:
            return super().compute_next_token_loss(
                example, key=key, reduction=reduction, reduction_axis=reduction_axis, **kw
            )
        Pos = example.tokens.resolve_axis(self.Pos.name)
        weight = hax.logical_not(hnn.one_hot(-1, Pos, dtype=jnp.bool_)).astype(jnp.float32)
        if example.loss_weight is not None:
            weight = weight * example.loss_weight.astype(jnp.float32)
        if key is None:
            logits = self.halting_exits(example.tokens, example.attn_mask).logits.astype(jnp.float32)
            return next_token_loss(
                Pos,
                self.Vocab,
                logits,
                example.tokens,
                example.loss_weight,
                reduction=reduction,
                reduction_axis=reduction_axis,
            )
        trunk = dataclasses.replace(self, halting_head=None)  # the trunk and exits, frozen
        frozen = jax.tree_util.tree_map(lambda a: jax.lax.stop_gradient(a) if eqx.is_array(a) else a, trunk)
        states = frozen.exit_states(example.tokens, example.attn_mask)
        target = frozen.oracle(example.tokens, states, weight)
        log_q = self.halting_head.log_q(frozen.halting_states(states))
        return halting_loss(log_q, target, self.config.Layers, alpha=self.config.halting.alpha, weight=weight)
