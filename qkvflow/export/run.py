"""Exporting a trained DiffEqFormer from its checkpoint (what `qkvflow export` runs; the command, its
options and its checks are in qkvflow.cli.export).

The run's model is loaded from the checkpoint (`qkvflow.runs.model`), discretised into M parallel
blocks (`qkvflow.models.discretise`) and written as a transformers folder with the run's tokenizer
(`qkvflow.export.hf_folder`); with `ode`, the full ODE model too, into OUT/ode (`qkvflow.export.ode`).
OUT is written into a temporary sibling and swapped in when complete (`qkvflow.outputs.replacing`,
under the replacement rules the caller gives).
"""

import os

from qkvflow import outputs
from qkvflow.export import hf_folder
from qkvflow.export.ode import save_ode_export
from qkvflow.models.discretise import discretise
from qkvflow.runs import model as run_model


def export_checkpoint(config, checkpoint: str, output: str, steps: int, solver: str, *, ode: bool, rules: dict) -> dict:
    """Write the model of `checkpoint` (a run of `config`) at `steps` layers into `output`; the summary
    `qkvflow export` prints: where, the Hugging Face model type, the layers, the trained N, whether the
    export computes exactly the model's Euler solve, and the files written."""
    model, tokenizer = run_model.load_model(config, checkpoint)
    discrete = discretise(model, steps, solver)
    with outputs.replacing(output, **rules) as folder:  # swapped in only when complete
        files = hf_folder.save_hf_folder(discrete, folder, tokenizer=tokenizer, ode_steps=config.model.ode.num_steps)
        if ode:
            files += save_ode_export(model, os.path.join(folder, "ode"))
        files = [os.path.join(output, os.path.relpath(f, folder)) for f in files]
    exact = steps == config.model.ode.num_steps and config.model.ode.solver == "euler"
    return {
        "output": output,
        "model_type": discrete.config.flavour_spec.hf_model_type,
        "layers": steps,
        "ode_steps": config.model.ode.num_steps,
        "equals_ode_solve": exact,
        "files": files,
    }
