"""Training: what the verbs that train (`qkvflow train`, `qkvflow finetune`) share, on Levanter's Trainer.

    session        a run's start-up: its checks, processes, Levanter's initialisation, the run lock, caches
    preflight      the config checks that run before anything is built
    run            a pretraining run, start to summary (what `qkvflow train` runs)
    loop           the run loop and the trainer it builds
    loss           the training loss (with the depth-dial recipes' part)
    adam           Adam's first moment of the hypernetwork projections in a narrower dtype; the decay mask
    faults         non-finite steps, interrupted checkpoint writes, preemption (with preemption)
    distributed    multi-process start-up
    sharding       per-device memory of parameters and optimizer state, from shapes alone
    halting_phase  the Depth-Adaptive Transformer's halting phase
    step           the one door for the layers that build a training step without training (plan, bench)

What a run *is* (its config, corpus, folder, checkpoints, lock, record, model loading) sits below, in
`qkvflow.runs`. Importing the package imports none of its modules.
"""
