"""Benchmarks behind `qkvflow bench MODE`: how fast and how much memory, and how good, each in its part.

* performance/ (`bench speed`, `bench scaling`): a DiffEqFormer and its Levanter GPT-2/Llama baseline of
  the same shape (layers = ODE steps), jitted training steps timed after compilation, in one process
  (speed: one JSON object) or one subprocess per point along ODE steps, d_emb, sequence length or batch
  (scaling: CSV + PNG in benchmarks/results/).
* comparison/ (`bench compare`): a study (benchmarks/compare/*.yaml) of models x learning rates x seeds,
  the learning rate chosen on a selection split and the test loss reported with seed spread and paired
  95% intervals against a baseline; resumable. Its package docstring lists its parts; docs/compare.md is
  its guide.
* quality (`bench quality`): DiffEqFormer, GPT-2 and the weight-shared ODE trained on Tiny Shakespeare
  with nanoGPT's CPU budget via `qkvflow train`; validation losses as JSON and a markdown table.
* exits (`bench exits`): the Depth-Adaptive Transformer's exits against n-layer models, from the
  checkpoints of a `bench compare` study.
* depth_merge (`bench depth`): the depth curves of several `bench compare` studies as one report.

Their output files follow qkvflow.outputs (an existing file is replaced only with --overwrite, and none
is written into the repository's tracked folders); `OUT_DIR` is the default folder of scaling, quality
and exits. The packages import nothing in their `__init__`: `qkvflow.cli.bench` imports a mode's module
only when that mode runs.
"""

OUT_DIR = "runs/bench"
"""Relative to the current folder; the shipped results in benchmarks/results/ are copies made by hand."""
