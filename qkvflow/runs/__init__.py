"""What a run is, for every verb: its config file and overrides, the corpus and tokenizer it resolves to
(and the tokenizer folder `qkvflow tokenizer` writes for it), its folder, checkpoints and array dtypes, its
lock, record and metrics, the output rules, and loading its model (pretrained or fine-tuned, discretised or
merged). Nothing here trains; `qkvflow.training` does, on top of this.

Importing the package imports none of its modules: the command line's early checks read the config
file and output rules before JAX or Levanter load.
"""
