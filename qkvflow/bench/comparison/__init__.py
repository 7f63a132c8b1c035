"""The comparison harness of `qkvflow bench compare`: models x learning rates x seeds, a learning rate
chosen on a selection split and the test loss reported with seed spread and paired 95% intervals.

* compare:      the verb (its options, the study's course from the first run to the report);
* study:        the study file read and checked, and each run's `qkvflow train` config;
* run_processes: each run as a `qkvflow train` or `qkvflow eval` process, and the results it leaves;
* report:       the report's JSON, markdown table and figure;
* stats:        seed statistics (mean, spread, the paired interval of a difference);
* run_configs:  each model's run config parsed as `qkvflow train` parses it, and its training FLOPs;
* matching:     a model declared by what it matches (parameters or training FLOPs), its width solved;
* lr_grid:      the learning-rate choice, its grid's edge and the rate beyond it;
* halves:       the selection and test halves of a user's own validation documents;
* study_folder: the work folder a study claims, and where its outputs may not go;
* pool:         `--jobs K`: at most K run processes at once, and stopping them;
* depth_curves: a study's `depth:` section, each chosen run evaluated at many solver grids.

docs/compare.md is its guide. Nothing is imported here.
"""
