"""`loss_vocab_block`: the cross-entropy's vocabulary block, the same for every model.

Reference, written here from the definition: with h_p the final hidden state at position p, W the lm
head [embed, vocab] and y_{p+1} the next token, the loss is

    mean over p < S-1 of  logsumexp_v (h_p . W[:, v]) - h_p . W[:, y_{p+1}]

(the last position has no next token), computed in float64 from the model's own h and W. Any vocabulary
block, from one that splits the vocabulary unevenly to one larger than it, must give it to float32
round-off, for Levanter's GPT-2 (whose method takes no block size: `levanter_loss_in_blocks` stands in for
it) and for the DiffEqFormer.
"""

import dataclasses
import functools

import haliax as hax
import jax
import jax.numpy as jnp
import jax.random as jrandom
import numpy as np
import pytest
from levanter.models.gpt2 import Gpt2Config
from levanter.models.lm_model import LmExample

from qkvflow.errors import UserError
from qkvflow.training.loss import levanter_loss_in_blocks, lm_loss, train_loss
from tests.helpers import Batch, Vocab, random_tokens, tiny_config, tiny_model

GPT2 = Gpt2Config(hidden_dim=32, num_heads=4, num_layers=2, max_seq_len=12)


def _example(config):
    tokens = random_tokens(config, seed=3)
    return hax.vmap(LmExample.causal, Batch)(tokens)


def _reference(model, example) -> float:
    h = model.activations(example.tokens, example.attn_mask)
    h = h[0] if isinstance(h, tuple) else h
    h = np.asarray(h.rearrange((Batch, model.Pos, model.Embed)).array, np.float64)
    w = np.asarray(model.get_lm_head().rearrange((model.Embed, model.Vocab)).array, np.float64)
    y = np.asarray(example.tokens.rearrange((Batch, model.Pos)).array)
    logits = h @ w  # [batch, pos, vocab]
    top = logits.max(-1, keepdims=True)
    lse = np.log(np.exp(logits - top).sum(-1)) + top[..., 0]
    picked = np.take_along_axis(logits[:, :-1], y[:, 1:, None], axis=-1)[..., 0]
    return float((lse[:, :-1] - picked).mean())


def _scalar(loss) -> float:
    loss = loss[0] if isinstance(loss, tuple) else loss
    return float(loss.scalar() if isinstance(loss, hax.NamedArray) else loss)


@pytest.mark.parametrize("block", [None, 7, 61, 64, 1000])
@pytest.mark.parametrize("family", ["gpt2", "diffeqformer"])
def test_every_block_gives_the_cross_entropy_of_the_definition(family, block):
    model = GPT2.build(Vocab, key=jrandom.PRNGKey(0)) if family == "gpt2" else tiny_model(tiny_config())
    example = _example(model.config)
    got = _scalar(lm_loss(model, example, vocab_block=block))
    # float32 sums over 61 logits and 22 positions: a few ulps of a loss near 4.1
    assert got == pytest.approx(_reference(model, example), rel=1e-5)


def test_the_block_path_is_levanters_own_loss_for_its_models():
    """`levanter_loss_in_blocks` copies the body of Levanter's `compute_next_token_loss`, which takes no
    block size: at Levanter's default block (None) both must agree bit for bit, with and without a z-loss,
    or Levanter has changed its method and the copy must follow."""
    model = GPT2.build(Vocab, key=jrandom.PRNGKey(0))
    example = _example(GPT2)
    for z in (0.0, 1e-2):
        ours = levanter_loss_in_blocks(model, example, None, z_loss_weight=z)
        theirs = model.compute_next_token_loss(example, logsumexp_weight=z)
        assert np.array_equal(np.asarray(ours.array), np.asarray(theirs.array)), z


def test_the_option_reaches_the_compiled_loss_of_both_models():
    """`train_loss(config)` binds `loss_vocab_block` (train, plan), and the block changes the program: one
    block covering the vocabulary leaves no loop over vocabulary blocks in the loss's jaxpr."""
    from qkvflow.runs.config import TrainConfig

    config = dataclasses.replace(TrainConfig(), loss_vocab_block=64)
    assert train_loss(config).keywords == {"z_loss_weight": 0.0, "vocab_block": 64}
    for model in (GPT2.build(Vocab, key=jrandom.PRNGKey(0)), tiny_model(tiny_config())):
        example = _example(model.config)
        loops = {}
        for block in (7, 64):
            jaxpr = jax.make_jaxpr(functools.partial(lm_loss, model, vocab_block=block))(example)
            loops[block] = str(jaxpr).count("while[") + str(jaxpr).count("scan[")
        assert loops[7] > loops[64], (type(model).__name__, loops)


@pytest.mark.parametrize("value", [0, -4])
def test_a_block_that_is_not_positive_is_refused_in_one_line(value):
    from qkvflow.runs.config import TrainConfig
    from qkvflow.training.preflight import check_values

    config = dataclasses.replace(TrainConfig(), loss_vocab_block=value)
    with pytest.raises(UserError) as error:
        check_values(config)
    assert str(error.value) == f"loss_vocab_block={value} is invalid: expected an integer >= 1"


def test_bf16_compute_keeps_the_loss_in_float32():
    """In a bf16 step the block path computes the softmax in float32, as Levanter's method does."""
    import jmp

    model = jmp.get_policy("p=f32,c=bfloat16").cast_to_compute(GPT2.build(Vocab, key=jrandom.PRNGKey(0)))
    example = _example(GPT2)
    assert levanter_loss_in_blocks(model, example, 64).dtype == jnp.float32


def test_bench_speed_times_both_models_with_the_block_it_is_given():
    """`bench speed --loss_vocab_block N` reaches both models' step (`train_step`), and the JSON records it."""
    import equinox as eqx
    import jmp

    from qkvflow.bench.performance.step import bench_optimizer, train_step

    for model in (GPT2.build(Vocab, key=jrandom.PRNGKey(0)), tiny_model(tiny_config())):
        params, static = eqx.partition(model, eqx.is_inexact_array)
        optimizer = bench_optimizer()
        opt_state = optimizer.init(params)
        example = _example(model.config)
        loops = {}
        for block in (7, 64):
            step = train_step(static, jmp.get_policy("p=f32,c=f32"), optimizer, block)
            jaxpr = str(jax.make_jaxpr(functools.partial(step, key=None))(params, opt_state, example))
            loops[block] = jaxpr.count("while[") + jaxpr.count("scan[")
        assert loops[7] > loops[64], (type(model).__name__, loops)


def test_a_diffeqformer_with_aligned_exits_takes_the_block_in_every_exit():
    """`exits: aligned` computes N exit losses of its own (`ode_exits.aligned_loss`): the block reaches each,
    with the same loss to round-off."""
    model = tiny_model(tiny_config(exits="aligned"))
    example = _example(model.config)
    losses = {block: _scalar(lm_loss(model, example, vocab_block=block)) for block in (None, 7)}
    assert losses[7] == pytest.approx(losses[None], rel=1e-5)
    loops = {}
    for block in (7, 64):
        jaxpr = str(jax.make_jaxpr(functools.partial(lm_loss, model, vocab_block=block))(example))
        loops[block] = jaxpr.count("while[") + jaxpr.count("scan[")
    assert loops[7] > loops[64], loops


def test_a_model_with_a_loss_of_its_own_refuses_the_block_in_one_line():
    """The Depth-Adaptive Transformer overrides `compute_next_token_loss` (its exits' losses): the block
    would bypass it, so the key is refused before training and by the loss itself."""
    from qkvflow.models.related.adaptive import AdaptiveGpt2Config
    from qkvflow.runs.config import TrainConfig
    from qkvflow.training.preflight import check_values

    adaptive = AdaptiveGpt2Config(max_seq_len=12, hidden_dim=32, num_heads=4, num_layers=2)
    expected = (
        "loss_vocab_block=64 does not reach AdaptiveLMHeadModel's loss, which is its own "
        "(compute_next_token_loss); leave loss_vocab_block null for this model"
    )
    with pytest.raises(UserError) as error:
        check_values(dataclasses.replace(TrainConfig(), model=adaptive, loss_vocab_block=64))
    assert str(error.value) == expected
    check_values(dataclasses.replace(TrainConfig(), model=adaptive))  # null: its own loss, as before
    model = adaptive.build(Vocab, key=jrandom.PRNGKey(0))
    with pytest.raises(UserError) as error:
        lm_loss(model, _example(adaptive), vocab_block=64)
    assert str(error.value) == expected


def test_a_models_auxiliary_loss_is_added_on_the_block_path():
    """Levanter's `activations` may return (activations, auxiliary loss) (a mixture of experts' balancing
    term): its `compute_next_token_loss` adds that term, and so must the block path. A GPT-2 whose
    activations carry a made-up auxiliary loss of 0.25: the block path gives the definition's
    cross-entropy plus 0.25, and Levanter's own method's value at its default block."""
    from levanter.models.gpt2 import Gpt2LMHeadModel

    class WithAux(Gpt2LMHeadModel):
        def activations(self, input_ids, attn_mask=None, *, key=None, pos_ids=None):
            return super().activations(input_ids, attn_mask, key=key, pos_ids=pos_ids), jnp.float32(0.25)

    plain = GPT2.build(Vocab, key=jrandom.PRNGKey(0))
    model = WithAux(plain.transformer, plain.embeddings)
    example = _example(GPT2)
    reference = _reference(plain, example) + 0.25
    for block in (7, 64):
        assert _scalar(lm_loss(model, example, vocab_block=block)) == pytest.approx(reference, rel=1e-5), block
    ours = levanter_loss_in_blocks(model, example, None)
    assert np.array_equal(np.asarray(ours.array), np.asarray(model.compute_next_token_loss(example).array))
