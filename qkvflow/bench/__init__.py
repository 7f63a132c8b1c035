"""`qkvflow bench speed|scaling|quality`: throughput, memory scaling and quality benchmarks.

* speed:   one process; a DiffEqFormer and its Levanter GPT-2/Llama baseline of the same shape
           (layers = ODE steps), jitted training steps timed after compilation; one JSON object.
* scaling: step time and peak memory against ODE steps, d_emb, sequence length or batch, each point
           in a fresh subprocess; CSV + PNG in benchmarks/results/.
* quality: DiffEqFormer, GPT-2 and the weight-shared ODE trained on Tiny Shakespeare with nanoGPT's
           CPU budget via `qkvflow train`; validation losses as JSON and a markdown table.
"""

import importlib

from qkvflow.errors import UserError

MODES = {
    "speed": "qkvflow.bench.speed",
    "scaling": "qkvflow.bench.scaling",
    "quality": "qkvflow.bench.quality",
}


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: qkvflow bench {" + "|".join(MODES) + "} [options]  (qkvflow bench MODE --help)")
        return 0
    mode, rest = argv[0], argv[1:]
    if mode not in MODES:
        raise UserError(f"unknown bench mode {mode!r}: expected one of {', '.join(MODES)}")
    return importlib.import_module(MODES[mode]).main(rest) or 0
