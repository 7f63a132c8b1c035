"""The command line's frame: what `qkvflow VERB ...` does before, around and besides a verb's own work.

The verbs (`qkvflow/cli/<verb>.py`) parse their arguments and call the library; this package holds what
they all share and what runs before any of them is imported:

* `early`: `--help` and the refusals that argv and the config file alone decide, answered with the
  standard library, PyYAML and light qkvflow modules only (no JAX, Levanter, draccus, transformers or
  NumPy), from `table.json`, which `table` renders from the verbs' own code (`python -m
  qkvflow.cli.startup.table`; a test pins it);
* `usage`: the one-screen `--help` of the config-driven verbs;
* `interrupt`: Ctrl-C as one line and exit status 130; `console`: what else the terminal shows;
* `dryparse` and `reference`, which read the verbs without running them: a command line parsed the way
  its verb parses it (the docs' command lines are checked with it), and the configuration reference
  the documentation site prints.

`early`, `usage` and `interrupt` are on the light path (`qkvflow --help`, `qkvflow VERB --help`, the
refusals): what they import at their top must stay light (tests/test_cli_early.py). This `__init__`
imports nothing.
"""
