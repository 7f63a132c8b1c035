"""`qkvflow plan`: compile the training step `qkvflow train` would run, for devices that are not here.

    from qkvflow.plan.hlo import count_kernels, collectives
    count_kernels(hlo_text)   # kernel launches per step, loops weighted by their trip counts
    collectives(hlo_text)     # all-gather / reduce-scatter / all-reduce ...: count and bytes per step

See `qkvflow.plan.planner` for the whole plan, docs/plan.md for the verb. The package itself imports
nothing: the command line reads `qkvflow.plan.targets` before NumPy or JAX is loaded (qkvflow.cli.startup.early).
"""
