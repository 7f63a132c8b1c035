"""How fast a training step runs and how much memory it takes: `qkvflow bench speed` and `bench scaling`.

* speed:    the `bench speed` verb: a DiffEqFormer and its baseline, each step compiled, warmed up and
            timed in one process (the largest batch that fits found on request); one JSON object.
* config:   the DiffEqFormer config it times, from a file, with the command line's changes and one
            attention kernel for every model;
* baseline: Levanter's GPT-2 or Llama of the same shape (layers = vector-field evaluations);
* step:     the timed training step (loss, gradient, Levanter's Adam), compiled as Levanter's trainer does;
* peak:     the device's peak FLOP/s: the measured matmul rate ("fraction of peak") and the nominal
            peak behind MFU (the model FLOPs are qkvflow.models.accounting's);
* memory:   memory figures, each labelled with what it measures;
* scaling:  the `bench scaling` verb: `bench speed` in a fresh subprocess per point along one axis (ODE
            steps, d_emb, sequence length, batch); CSV + PNG.

Nothing is imported here (speed, step and peak import JAX).
"""
