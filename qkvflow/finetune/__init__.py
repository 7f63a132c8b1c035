"""Fine-tuning a pretrained DiffEqFormer at M layers: the run (`qkvflow.finetune.run`: discretise, add
LoRA or train in full, export) and a grid of such runs (`qkvflow.finetune.sweep`). What a fine-tuned run
*is* (its config, loading it with the adapters merged) sits below, in `qkvflow.runs`, so that the verbs
that read one (`eval`, `generate`, `export`) do not import the training loop.
"""
