"""Cached decoding equals the uncached model: logits step by step, and greedy tokens through the engine."""

import dataclasses

import numpy as np
import pytest

from qkvflow.inference.decoders import decoder_for
from qkvflow.inference.generate import SamplingOptions, generate
from qkvflow.inference.stepper import CachedStepper
from qkvflow.integrate.config import OdeConfig
from qkvflow.integrate.solve import build_solver
from qkvflow.integrate.solvers import evaluations
from tests.helpers import tiny_config, tiny_model
from tests.inference.util import (
    CONTEXT,
    CharTokenizer,
    full_logits,
    greedy_reference,
    ode_model,
    on_grid,
    parallel_model,
    round_off,
)

SEQ = [int(t) for t in np.random.RandomState(3).randint(0, 61, 12)]
PROMPT = 5

# (flavour, solver, trained N, decoding N'): both flavours, Euler and a multi-stage method, N' == N and N' != N
ODE_CASES = [
    ("gpt2", "euler", 3, 3),
    ("gpt2", "euler", 3, 5),
    ("gpt2", "heun", 2, 2),
    ("gpt2", "heun", 2, 3),
    ("llama", "euler", 3, 3),
    ("llama", "euler", 3, 2),
    ("llama", "rk4", 1, 1),
    ("llama", "rk4", 1, 2),
]


def stepwise_logits(decoder, prompt=1) -> np.ndarray:
    """Prefill the first `prompt` tokens, then feed the rest one at a time; every logit row. (The
    multi-token prefill is checked for the parallel model here and for all through the engine below;
    one shape per decoder keeps the compile count down.)"""
    step = CachedStepper(decoder, CONTEXT)
    rows = [np.asarray(step(SEQ[:prompt]).array)]
    rows += [np.asarray(step([t]).array) for t in SEQ[prompt:]]
    return np.concatenate(rows)


def assert_close(cached, reference, nfe, hidden=32):
    tol = round_off(nfe, hidden, float(np.abs(reference).max()))
    err = float(np.abs(cached - reference).max())
    assert err <= tol, f"cached logits differ by {err:.3g} > {tol:.3g}"


@pytest.mark.parametrize("flavour,solver,n,n_decode", ODE_CASES)
def test_cached_logits_equal_full_forward(flavour, solver, n, n_decode):
    model = ode_model(flavour, solver, n)
    reference = full_logits(on_grid(model, n_decode), SEQ)
    cached = stepwise_logits(decoder_for(model, n_decode if n_decode != n else None))
    nfe = int(evaluations(build_solver(on_grid(model, n_decode).config.ode), n_decode))
    assert_close(cached, reference, nfe)
    # the grid matters: N' != N changes the logits by far more than round-off
    if n_decode != n:
        other = full_logits(model, SEQ)
        assert np.abs(other - reference).max() > 100 * round_off(nfe, 32, float(np.abs(reference).max()))


@pytest.mark.parametrize("n,n_decode", [(3, 3), (3, 5)])
def test_official_variant_cached_logits_equal_full_forward(n, n_decode):
    """The official variant's time grid t_k = (k+1)/N (qkvflow.models.official) reaches the decoder: a
    decoder that stepped on qkvflow's grid t_k = k/N would differ by far more than round-off."""
    config = tiny_config("gpt2", ode=OdeConfig(num_steps=n, solver="euler"), max_seq_len=CONTEXT, variant="official")
    model = tiny_model(config, 0)
    reference = full_logits(on_grid(model, n_decode), SEQ)
    cached = stepwise_logits(decoder_for(model, n_decode if n_decode != n else None))
    # the variant does not divide its generated weights by d_emb, so each evaluation's field, and the
    # round-off it adds, is up to d_emb times that of qkvflow's model at the same hypernetwork output
    tol = round_off(n_decode, 32, float(np.abs(reference).max())) * config.time_embed_dim
    err = float(np.abs(cached - reference).max())
    assert err <= tol, f"cached logits differ by {err:.3g} > {tol:.3g}"
    left = tiny_model(dataclasses.replace(config, time_grid="left"), 0)  # the same weights, read at k/N
    other = full_logits(on_grid(left, n_decode), SEQ)
    assert np.abs(other - reference).max() > 100 * tol


@pytest.mark.parametrize("flavour,solver,n,n_decode", [("gpt2", "euler", 3, 5), ("llama", "heun", 2, 2)])
def test_shared_ode_cached_logits_equal_full_forward(flavour, solver, n, n_decode):
    """The weight-shared model (constant W plus c t, a generator of its own) decodes through the same
    per-evaluation caches; its slopes c start at 0, so
    every generator array gets noise here, to make W(t) move."""
    import equinox as eqx
    import jax

    from qkvflow.integrate.config import OdeConfig
    from qkvflow.models import registry
    from tests.helpers import Vocab
    from tests.inference.util import CONTEXT

    config = registry.family(f"shared_ode_{flavour}").config_class(
        max_seq_len=CONTEXT, hidden_dim=32, num_heads=4, ode=OdeConfig(num_steps=n, solver=solver)
    )
    model = config.build(Vocab, key=jax.random.PRNGKey(0))
    leaves, treedef = jax.tree_util.tree_flatten(eqx.filter(model.generator, eqx.is_array))
    keys = jax.random.split(jax.random.PRNGKey(1), len(leaves))
    noisy = [x + 0.05 * jax.random.normal(k, x.shape, x.dtype) for x, k in zip(leaves, keys)]
    generator = eqx.combine(jax.tree_util.tree_unflatten(treedef, noisy), model.generator)
    model = eqx.tree_at(lambda m: m.generator, model, generator)
    reference = full_logits(on_grid(model, n_decode), SEQ)
    cached = stepwise_logits(decoder_for(model, n_decode if n_decode != n else None))
    nfe = int(evaluations(build_solver(on_grid(model, n_decode).config.ode), n_decode))
    assert_close(cached, reference, nfe)


@pytest.mark.parametrize("flavour,scheme", [("gpt2", "rk2_gated"), ("llama", "rk4")])
def test_runge_kutta_blocks_decode_with_a_cache_per_stage(flavour, scheme):
    """A Runge-Kutta block attends once per stage from another state: one cache per layer and stage."""
    import jax

    from qkvflow.models import registry
    from qkvflow.models.discrete.schemes import STAGES
    from tests.helpers import Vocab
    from tests.inference.util import CONTEXT

    config = registry.family(f"parallel_{flavour}").config_class(
        max_seq_len=CONTEXT, hidden_dim=32, num_heads=4, num_layers=2, block_scheme=scheme
    )
    model = config.build(Vocab, key=jax.random.PRNGKey(0))
    assert_close(stepwise_logits(decoder_for(model), PROMPT), full_logits(model, SEQ), nfe=2 * STAGES[scheme])


@pytest.mark.parametrize("flavour", ["gpt2", "llama"])
def test_parallel_cached_logits_equal_full_forward(flavour):
    model = parallel_model(flavour)
    assert_close(stepwise_logits(decoder_for(model), PROMPT), full_logits(model, SEQ), nfe=3)


# Greedy through Levanter's engine (prefill, paged cache, sampler at temperature 0), token for token.
ENGINE_CASES = {
    "gpt2-heun-N2-N'3": lambda: (ode_model("gpt2", "heun", 2), 3),
    "llama-euler-N3": lambda: (ode_model("llama", "euler", 3), None),
    "parallel-gpt2": lambda: (parallel_model("gpt2"), None),
}


@pytest.mark.parametrize("case", sorted(ENGINE_CASES))
def test_engine_greedy_equals_uncached_argmax(case):
    model, steps = ENGINE_CASES[case]()
    reference_model = on_grid(model, steps) if steps else model
    tok = CharTokenizer()
    prompts = ["Hello", "xyz!"]
    new = 8
    out = generate(model, tok, prompts, SamplingOptions(max_new_tokens=new, temperature=0.0), steps=steps)
    for prompt, completion in zip(prompts, out):
        expected, margin = greedy_reference(reference_model, tok(prompt)["input_ids"], new)
        assert margin > round_off(10, 32, 1.0), "reference has a near-tie: the comparison would be round-off"
        assert completion.tokens == expected
        assert completion.finish_reason == "length"
