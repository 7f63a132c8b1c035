"""Benchmarks behind `qkvflow bench speed|scaling|quality`: throughput, memory scaling and quality benchmarks.

* speed:   one process; a DiffEqFormer and its Levanter GPT-2/Llama baseline of the same shape
           (layers = ODE steps), jitted training steps timed after compilation; one JSON object.
* scaling: step time and peak memory against ODE steps, d_emb, sequence length or batch, each point
           in a fresh subprocess; CSV + PNG in benchmarks/results/.
* quality: DiffEqFormer, GPT-2 and the weight-shared ODE trained on Tiny Shakespeare with nanoGPT's
           CPU budget via `qkvflow train`; validation losses as JSON and a markdown table.
"""
