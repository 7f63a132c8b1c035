"""`qkvflow eval` on checkpoints of `qkvflow finetune`: the discretised M-layer model, LoRA merged.

The runs are tests/finetune_utils.finetuned: 2 steps at M = 4 layers (LoRA, and full fine-tuning) of
a tiny DiffEqFormer, in this process, shared with tests/inference/test_generate_finetune.py. Each run's
last validation loss (`eval_loss` of its summary, logged as `eval/loss`) is the reference: `qkvflow
eval` on the run's config and checkpoint scores the same batches with the same evaluator.
"""

import json

import numpy as np
import pytest

from qkvflow.cli import main as cli_main
from tests.finetune_utils import finetuned

EPS32 = float(np.finfo(np.float32).eps)
CONTEXT = 32  # tests/configs/tiny_train.yaml: model.max_seq_len


def _eval(capfd, args, checkpoint, *extra):
    rc = cli_main(["eval", *args, "--checkpoint", str(checkpoint), *extra])
    out, err = capfd.readouterr()
    return rc, out, err


def loglikelihood(model, tokenizer, context: str, continuation: str) -> float:
    """sum_j log p(ids[j] | ids[<j]) over the continuation's tokens, the request alone from position 0
    (as tests/evaluation/test_harness.py's reference), with one compiled forward of the padded context
    (tests/inference/util.full_logits; causal, so the padding after the request changes nothing)."""
    import jax

    from tests.inference.util import full_logits

    ids = tokenizer.encode_batch([context + continuation])[0]
    n_context = len(tokenizer.encode_batch([context])[0])
    logp = np.asarray(jax.nn.log_softmax(np.asarray(full_logits(model, ids, CONTEXT), np.float64), axis=-1))
    return float(sum(logp[j - 1, ids[j]] for j in range(n_context, len(ids))))


@pytest.fixture(scope="module")
def lora_eval(tmp_path_factory, corpus_root):
    """`qkvflow eval --tasks TASK --output DIR` on the LoRA run: (the run, depth.json, stdout). The task
    is multiple choice, its answers set from log-likelihoods of the fine-tuned model in memory (LoRA
    unmerged): the most likely choice for even documents and the least likely for odd ones."""
    import contextlib
    import io

    pytest.importorskip("lm_eval")
    from qkvflow.runs.corpus import with_corpus
    from tests.evaluation.test_harness import CHOICES, QUESTIONS, _write_task

    run = finetuned(tmp_path_factory, corpus_root, "lora")
    args, checkpoint, config, summary = run
    tokenizer, model = with_corpus(config).data.the_tokenizer, summary["model"]
    ref = np.array([[loglikelihood(model, tokenizer, q, " " + c) for c in CHOICES] for q in QUESTIONS])
    answers = [int(np.argmax(r)) if i % 2 == 0 else int(np.argmin(r)) for i, r in enumerate(ref)]
    folder = tmp_path_factory.mktemp("lora_eval")
    task = _write_task(folder, answers)
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        rc = cli_main([
            "eval", *args, "--checkpoint", str(checkpoint),
            "--tasks", task, "--log_samples", "true", "--output", str(folder / "out"),
        ])  # fmt: skip
    assert rc == 0
    return run, ref, json.loads((folder / "out" / "depth.json").read_text()), stdout.getvalue()


def check_final_loss(summary: dict, result: dict, stdout: str) -> None:
    """The run evaluated its model as the trainer holds it (LoRA: W x + B (A x) s); eval scores the
    loaded model (LoRA merged: (W + s B A) x). Same batches and loss: they agree to float32 round-off
    of the mean over the tokens (16 eps, as for `qkvflow train` in test_perplexity.py; the merge changes
    each logit by a few eps of the largest, far below that after the mean). The fine-tuning moved the
    loss by much more than that, so a model loaded without its fine-tuned parameters fails."""
    loss, before = summary["eval_loss"], summary["initial_eval_loss"]
    assert abs(loss - before) > 1e3 * EPS32 * loss  # the test can tell the fine-tuned model from its base
    rows = result["rows"]
    assert [(r["grid"], r["trained"]) for r in rows] == [("4 layers", True)]
    assert rows[0]["loss"] == pytest.approx(loss, rel=16 * EPS32, abs=0)
    assert "| - | 4 layers (trained) | - |" in stdout


def test_lora_eval_equals_the_runs_own_final_eval_loss(lora_eval):
    (_, _, _, summary), _, result, stdout = lora_eval
    check_final_loss(summary, result, stdout)


@pytest.mark.slow  # a second fine-tuning run (20 s on a loaded 2-core CPU); the LoRA one above is in the default suite
def test_full_eval_equals_the_runs_own_final_eval_loss(tmp_path_factory, corpus_root, capfd, tmp_path):
    args, checkpoint, _, summary = finetuned(tmp_path_factory, corpus_root, "full")
    rc, out, err = _eval(capfd, args, checkpoint, "--output", str(tmp_path / "eval"))
    assert rc == 0, err
    check_final_loss(summary, json.loads((tmp_path / "eval" / "depth.json").read_text()), out)


def test_grid_options_are_refused_for_a_finetune_config(tmp_path_factory, corpus_root, capfd):
    """--steps and --solver are keys of the fine-tuning config (its depth M and discretisation): given
    to `qkvflow eval` they would rebuild another model, so they are refused before any work."""
    args, checkpoint, _, _ = finetuned(tmp_path_factory, corpus_root, "lora")
    capfd.readouterr()  # what the fixture printed when this test built it
    for extra in (["--steps", "2,4"], ["--solver=rk4"], ["--tolerances", "1e-3"], ["--auto_tolerance", "0.1"]):
        rc, _, err = _eval(capfd, args, checkpoint, *extra)
        key = extra[0].split("=")[0]
        assert rc == 2 and len(err.strip().splitlines()) == 1, err
        assert err.startswith(f"qkvflow eval: error: {key}: ") and "is a `qkvflow finetune` config" in err


def test_a_checkpoint_of_another_model_is_refused_in_one_line(tmp_path_factory, corpus_root, capfd):
    """The LoRA run's checkpoint read with another fine-tuning config: full fine-tuning (the whole model,
    which the LoRA checkpoint does not hold), and LoRA of another rank."""
    args, checkpoint, _, _ = finetuned(tmp_path_factory, corpus_root, "lora")
    for extra, expected in (
        (["--finetune", "full"], "does not hold the model that full fine-tuning of this config trains: it lacks"),
        (["--lora.r", "2"], "does not hold the model that lora fine-tuning of this config trains"),
    ):
        rc, _, err = _eval(capfd, args, checkpoint, *extra)
        assert rc == 2 and len(err.strip().splitlines()) == 1, err
        assert expected in err, err


def test_tasks_on_a_lora_checkpoint_score_the_fine_tuned_model(lora_eval):
    """Levanter's harness on the loaded (merged) model: each choice's log-likelihood is the fine-tuned
    model's in memory (float32 forward passes of the packed and the single request, sums of <= 10
    log-probs of ~7.6 nats: 1e-4, as in test_harness.py), so it picks the choices that model ranks first
    (even documents) and last (odd ones): accuracy exactly 1/2."""
    from tests.evaluation.test_harness import QUESTIONS

    _, reference, result, stdout = lora_eval
    assert [(r["grid"], r["trained"]) for r in result["lm_eval"]] == [("4 layers", True)]
    lm_eval = result["lm_eval"][0]
    assert lm_eval["results"]["qkvflow_tiny_mc"]["acc,none"] == 0.5
    assert "| - | 4 layers (trained) | qkvflow_tiny_mc | acc | 0.5000 |" in stdout
    scored = {s["doc_id"]: [r[0][0] for r in s["resps"]] for s in lm_eval["samples"]["qkvflow_tiny_mc"]}
    np.testing.assert_allclose([scored[i] for i in range(len(QUESTIONS))], reference, rtol=0, atol=1e-4)


def test_loading_a_finetuned_run_names_the_step_folder_it_loaded(tmp_path_factory, corpus_root, capfd):
    """Given the run folder, the loader says on stderr which step-N folder it read (the newest, found here
    from the folder names), not the run folder (issue 56, mutation-audit survivor M24)."""
    from qkvflow.runs.model import load_run_model

    _, checkpoint, config, _ = finetuned(tmp_path_factory, corpus_root, "lora")
    steps = sorted(int(p.name.removeprefix("step-")) for p in checkpoint.glob("step-*"))
    capfd.readouterr()
    load_run_model(config, str(checkpoint))
    said = [line for line in capfd.readouterr().err.splitlines() if line.startswith("loaded checkpoint")]
    assert said == [f"loaded checkpoint {checkpoint / f'step-{steps[-1]}'}"], said
