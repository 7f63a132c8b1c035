"""`qkvflow eval`'s library: perplexity and bits per byte with the training run's own evaluator
(`perplexity`), the same DiffEqFormer at several solver grids and tolerances (`depth`), and
EleutherAI's lm-evaluation-harness through Levanter's (`harness`)."""
