"""`qkvflow plan`: compile the training step `qkvflow train` would run, for devices that are not here.

    from qkvflow.plan import count_kernels, collectives
    count_kernels(hlo_text)   # kernel launches per step, loops weighted by their trip counts
    collectives(hlo_text)     # all-gather / reduce-scatter / all-reduce ...: count and bytes per step

See `qkvflow.plan.planner` for the whole plan, docs/plan.md for the verb.
"""

from qkvflow.plan.hlo import collectives, count_kernels  # noqa: F401
