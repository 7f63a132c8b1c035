"""A run whose depth-dial recipes draw a grid per step (qkvflow.models.depth_dial) is reproducible and
resumes bit-exactly: the draws come from Levanter's training key, which the checkpoint holds."""

from tests.train_utils import cli_in_one_process, losses, train_args, train_env

# step counts {1, 2} drawn per batch on grids jittered within their intervals; 4 steps, no evaluation
DIAL = ["--model.dial", "{train_steps: [1, 2], jitter: 0.5}", "--trainer.num_train_steps", "4"]
QUIET = ["--trainer.max_eval_batches", "0", "--loss_curve", "null"]


def test_drawn_grids_reproduce_and_resume_bit_exactly(tmp_path_factory, corpus_root):
    from qkvflow.runs.tracking import metrics_file, read_metrics

    whole, stopped = (tmp_path_factory.mktemp(n) for n in ("dial-whole", "dial-stop"))
    cases = {
        "whole": train_args(whole, corpus_root, *DIAL, *QUIET)[3:],
        "stop": train_args(stopped, corpus_root, *DIAL, *QUIET, "--stop_after", "2")[3:],
        "resume": train_args(stopped, corpus_root, *DIAL, *QUIET)[3:],
    }
    # equinox's checks as NaNs, not host callbacks: diffrax's StepTo (the jittered grids) checks its times with
    # one, and JAX caches no program that has one, so each run would compile the training step afresh
    results = cli_in_one_process(cases, train_env(1, EQX_ON_ERROR="nan"), cwd=tmp_path_factory.getbasetemp())
    for case, (code, _, stderr) in results.items():
        assert code == 0, (case, stderr[-3000:])
    assert "resuming run tiny after step 2" in results["resume"][1]
    reference = losses(whole)
    assert len(reference) == 4
    # reproducible (steps 1-2 of the stopped run) and resumed bit-exactly (the same grids at steps 3-4)
    assert losses(stopped) == reference
    steps = read_metrics(metrics_file(str(whole / "runs"), "tiny"))
    drawn = [steps[s]["train/dial_steps"] for s in sorted(steps) if "train/dial_steps" in steps[s]]
    assert len(drawn) == 4 and set(drawn) <= {1.0, 2.0}
