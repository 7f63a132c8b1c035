"""Text generation with KV caches on Levanter's inference engine (`levanter.inference`).

* `paged`: the attention hook that appends K/V to a paged cache and attends over it.
* `schedule`: a fixed-step solve as a list of "layers" (one per vector-field evaluation).
* `decoders`: the model side of the engine (`initial_cache`, `decode`) for the DiffEqFormer and the
  discretised parallel model.
* `sampling`: the engine's sampler plus top-k.
* `generate`: prompts in, completions out.
"""
