"""How fast a training step runs and how much memory it takes: `qkvflow bench speed` and `bench scaling`.

* speed:   one process; a DiffEqFormer and its Levanter baseline of the same shape, each training step
           compiled, warmed up and timed; tokens/s, MFU and memory as one JSON object.
* scaling: `bench speed` in a fresh subprocess per point along one axis (ODE steps, d_emb, sequence
           length, batch); CSV + PNG.
* peak:    the device's measured matmul rate, the denominator of "fraction of peak".
* memory:  memory figures, each labelled with what it measures.

Nothing is imported here: a module of this package imports JAX when it is imported.
"""
