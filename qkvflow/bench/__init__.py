"""Benchmarks behind `qkvflow bench speed|scaling|quality|compare`: throughput, memory scaling and quality benchmarks.

* speed:   one process; a DiffEqFormer and its Levanter GPT-2/Llama baseline of the same shape
           (layers = ODE steps), jitted training steps timed after compilation; one JSON object.
* scaling: step time and peak memory against ODE steps, d_emb, sequence length or batch, each point
           in a fresh subprocess; CSV + PNG in benchmarks/results/.
* quality: DiffEqFormer, GPT-2 and the weight-shared ODE trained on Tiny Shakespeare with nanoGPT's
           CPU budget via `qkvflow train`; validation losses as JSON and a markdown table.
* compare: a study (benchmarks/compare/*.yaml) of models x learning rates x seeds, the learning rate
           chosen on a selection split and the test loss reported with seed spread and paired 95%
           intervals against a baseline (qkvflow.bench.stats); resumable. Its parts: the study's run
           configs (run_configs), matched baselines (matching), the learning-rate grid's edge (lr_grid),
           the work folder (study_folder), the data halves of a user's corpus (halves), the run pool
           (pool) and the report (compare_report). docs/compare.md is its guide.

Their output files follow qkvflow.runs.outputs (an existing file is replaced only with --overwrite, and none
is written into the repository's tracked folders); `OUT_DIR` is the default folder of scaling, quality
and exits.
"""

OUT_DIR = "runs/bench"
"""Relative to the current folder; the shipped results in benchmarks/results/ are copies made by hand."""
