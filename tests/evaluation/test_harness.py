"""`qkvflow eval --tasks`: lm-evaluation-harness through Levanter's harness, offline.

A multiple-choice task is written by the test (a task YAML with `dataset_path: json` and a local
jsonl file). The reference log-likelihood of each choice is computed here from the model's logits,
each request scored alone from position 0: sum over the continuation tokens of log softmax(logits).
The answers are set from that reference (the most likely choice for even documents, the least likely
for odd ones), so the harness's accuracy must be exactly 1/2.
"""

import json
import sys

import equinox as eqx
import numpy as np
import pytest

from qkvflow.cli import main as cli_main
from tests.finetune_utils import TINY_TRAIN, save_fresh_checkpoint

pytest.importorskip("lm_eval")

QUESTIONS = [
    "The for statement is used to iterate over",
    "A function definition defines a",
    "The return statement leaves the current",
    "An exception is raised when",
]
CHOICES = ["the elements of a sequence", "zq", "function call with the expression list", "x y z w"]


@pytest.fixture(scope="module")
def run(tmp_path_factory, corpus_root):
    """(config, model, tokenizer, checkpoint) of a freshly initialised tiny DiffEqFormer (GPT-2 flavour)."""
    from qkvflow.cli import parse
    from qkvflow.cli.eval import EvalConfig
    from qkvflow.runs.corpus import with_corpus
    from qkvflow.runs.model import load_model

    path = save_fresh_checkpoint(tmp_path_factory.mktemp("harness") / "ckpt", corpus_root)
    config = with_corpus(parse(EvalConfig, ["--config_path", TINY_TRAIN, "--corpus.root", str(corpus_root)], "eval"))
    model, _ = load_model(config, str(path))
    return config, model, config.data.the_tokenizer, path


@eqx.filter_jit
def _forward(model, ids):
    return model(ids).array


def reference_loglikelihood(model, tokenizer, context: str, continuation: str) -> float:
    """sum_j log p(ids[j] | ids[<j]) over the continuation's tokens, the request alone (Levanter's
    harness tokenizes context + continuation and the context without special tokens)."""
    import haliax as hax
    import jax

    ids = tokenizer.encode_batch([context + continuation])[0]
    n_context = len(tokenizer.encode_batch([context])[0])
    # padded to the context after its end, which a causal model cannot see from earlier positions: one
    # compiled forward for every request (each length compiled its own solve)
    padded = np.zeros(model.Pos.size, np.int32)
    padded[: len(ids)] = ids
    logits = np.asarray(_forward(model, hax.named(padded, model.Pos)), np.float64)[: len(ids)]
    logp = np.asarray(jax.nn.log_softmax(logits, axis=-1))
    return float(sum(logp[j - 1, ids[j]] for j in range(n_context, len(ids))))


def _write_task(folder, answers) -> str:
    docs = [{"question": q, "choices": CHOICES, "answer": a} for q, a in zip(QUESTIONS, answers)]
    (folder / "mc.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    task = folder / "tiny_mc.yaml"
    task.write_text(
        "task: qkvflow_tiny_mc\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: mc.jsonl\n"
        "output_type: multiple_choice\ntest_split: test\ndoc_to_text: '{{question}}'\n"
        "doc_to_choice: '{{choices}}'\ndoc_to_target: '{{answer}}'\nmetric_list:\n  - metric: acc\n"
    )
    return str(task)


def test_multiple_choice_matches_log_likelihoods_from_the_logits(run, tmp_path):
    from qkvflow.evaluation import harness

    config, model, tokenizer, _ = run
    reference = np.array([[reference_loglikelihood(model, tokenizer, q, " " + c) for c in CHOICES] for q in QUESTIONS])
    answers = [int(np.argmax(r)) if i % 2 == 0 else int(np.argmin(r)) for i, r in enumerate(reference)]
    spec = harness.task_spec(_write_task(tmp_path, answers))
    out = harness.run(model, config, spec, log_samples=True)
    assert out["results"]["qkvflow_tiny_mc"]["acc,none"] == 0.5
    scored = {s["doc_id"]: [r[0][0] for r in s["resps"]] for s in out["samples"]["qkvflow_tiny_mc"]}
    got = np.array([scored[i] for i in range(len(QUESTIONS))])
    # float32 forward passes of the packed and the single request: sums of <= 10 log-probs of ~7.6 nats
    np.testing.assert_allclose(got, reference, rtol=0, atol=1e-4)


def test_a_task_file_is_built_from_its_own_keys_whatever_the_index_holds(tmp_path):
    """A call that names only task files builds no index of lm-eval's built-in tasks (12-18 s): a task
    definition is built from its own keys, so an empty index gives the task a full one would. Checked
    against an index that holds another task of the same name (a folder of its own, not the built-in
    15,000): the definition wins there too. Names and groups need the index."""
    import lm_eval.tasks as tasks

    from qkvflow.evaluation import harness

    spec = harness.task_spec(_write_task(tmp_path, [0, 1, 2, 3]))
    assert not harness.needs_index(spec)
    assert harness.needs_index(["arc_easy"]) and harness.needs_index([*spec, "arc_easy"])
    assert harness.needs_index([{"group": "mine", "task": ["arc_easy"]}])
    other = tmp_path / "index"
    other.mkdir()
    (other / "same_name.yaml").write_text(
        open(tmp_path / "tiny_mc.yaml").read().replace("'{{question}}'", "'Q: {{question}}'")
    )

    def built(manager):
        (task,) = harness._tasks(tasks.get_task_dict(spec, manager))
        return task.config.doc_to_text, task.OUTPUT_TYPE, [task.doc_to_text(d) for d in task.test_docs()]

    assert tasks.TaskManager(include_defaults=False, include_path=str(other)).all_tasks == ["qkvflow_tiny_mc"]
    empty = harness.task_manager(False)
    assert empty.all_tasks == []
    assert built(empty) == built(tasks.TaskManager(include_defaults=False, include_path=str(other)))
    assert built(empty) == ("{{question}}", "multiple_choice", QUESTIONS)


def test_packed_requests_restart_their_positions():
    import haliax as hax

    from qkvflow.evaluation.harness import segment_positions

    seg = hax.named(np.array([[0, 0, 0, 1, 1, 2, -1, -1], [5, 5, 5, 5, 5, 5, 5, 5]]), ("batch", "position"))
    np.testing.assert_array_equal(
        np.asarray(segment_positions(seg, "position").array), [[0, 1, 2, 0, 1, 0, 0, 1], list(range(8))]
    )


def test_levanter_still_lacks_loglikelihood_rolling():
    """qkvflow adds rolling log-likelihood because Levanter's harness raises on it; when Levanter
    implements it, this fails and qkvflow.evaluation.rolling should go."""
    from levanter.eval_harness import LevanterHarnessLM

    with pytest.raises(NotImplementedError):
        LevanterHarnessLM.loglikelihood_rolling(object(), [])


def test_cli_tasks_at_several_grids_and_one_line_refusals(run, tmp_path, capfd, monkeypatch):
    """`--tasks T --steps 1,2`: lm-eval runs once per grid on the model integrated on that grid (the
    harness's scores against the logits are test_multiple_choice_...'s), one table row per grid, and
    lm-eval's index of its tasks is built once for the call; then the refusals."""
    from qkvflow.evaluation import harness

    capsys = capfd  # the token cache builder needs a real stderr file descriptor
    config, model, tokenizer, path = run
    base = ["eval", "--config_path", TINY_TRAIN, "--corpus.root", str(config.corpus.root), "--checkpoint", str(path)]
    task = _write_task(tmp_path, [0, 1, 2, 3])
    seen, real = [], harness.run

    def spy(model, *args, **kwargs):
        out = real(model, *args, **kwargs)
        seen.append(
            (model.config.ode.solver, model.config.ode.num_steps, out["results"]["qkvflow_tiny_mc"]["acc,none"])
        )
        return out

    import lm_eval.tasks

    harness.task_manager.cache_clear()
    indexed, index = [], lm_eval.tasks.TaskManager.__init__
    with monkeypatch.context() as patch:
        patch.setattr(harness, "run", spy)
        patch.setattr(lm_eval.tasks.TaskManager, "__init__", lambda *a, **k: indexed.append(k) or index(*a, **k))
        assert cli_main([*base, "--tasks", task, "--steps", "1,2", "--output", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    assert [s[:2] for s in seen] == [("euler", 1), ("euler", 2)]
    # lm-eval's task index built once, by the preload, and shared by both grids' runs; empty, as the only
    # task is a task file (`needs_index`)
    assert indexed == [{"include_defaults": False}]
    rows = [line for line in out.splitlines() if "| qkvflow_tiny_mc | acc |" in line]
    assert rows == [
        f"| euler | N=1 | qkvflow_tiny_mc | acc | {seen[0][2]:.4f} | - |",
        f"| euler | N=2 (trained) | qkvflow_tiny_mc | acc | {seen[1][2]:.4f} | - |",
    ]
    written = json.loads((tmp_path / "out" / "depth.json").read_text())["lm_eval"]
    assert [(r["steps"], r["results"]["qkvflow_tiny_mc"]["acc,none"]) for r in written] == [
        (1, seen[0][2]),
        (2, seen[1][2]),
    ]
    # a missing data file: one line at once, not lm-eval's 10 retries with backoff
    bad = tmp_path / "bad.yaml"
    bad.write_text(open(task).read().replace("mc.jsonl", "missing.jsonl"))
    assert cli_main([*base, "--tasks", str(bad)]) == 2
    err = capsys.readouterr().err.strip()
    assert "data_files 'missing.jsonl' does not exist" in err and len(err.splitlines()) == 1
    # issue 56, item 8: an empty data file is named (lm-eval said "StopIteration"); a generate_until task is
    # refused before its data is built, without a progress bar (its data file is new to the datasets cache)
    (tmp_path / "empty.jsonl").write_text("\n")
    empty = tmp_path / "empty.yaml"
    empty.write_text(open(task).read().replace("mc.jsonl", "empty.jsonl"))
    assert cli_main([*base, "--tasks", str(empty)]) == 2
    err = capsys.readouterr().err.strip()
    assert "data_files 'empty.jsonl' is empty: expected the task's documents" in err and len(err.splitlines()) == 1
    (tmp_path / "generate.jsonl").write_text((tmp_path / "mc.jsonl").read_text())
    generate = tmp_path / "generate.yaml"
    generate.write_text(
        open(task).read().replace("multiple_choice", "generate_until").replace("mc.jsonl", "generate.jsonl")
    )
    assert cli_main([*base, "--tasks", str(generate)]) == 2
    err = capsys.readouterr().err.strip()
    assert "needs generate_until" in err and len(err.splitlines()) == 1 and "\r" not in err, err
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # as if not installed
    assert cli_main([*base, "--tasks", task]) == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith("pip install 'qkvflow[eval]'") and len(err.splitlines()) == 1


DOCS = [
    "The for statement in Python differs a bit from what you may be used to in C or Pascal. Rather than "
    "always iterating over an arithmetic progression of numbers, or giving the user the ability to define "
    "both the iteration step and halting condition, the for statement iterates over the items of any sequence.",
    "A function definition defines a user-defined function object.",
]


def test_rolling_perplexity_task_from_windows_scored_alone(run, tmp_path):
    """A wikitext-style task (output_type loglikelihood_rolling) on a local file: the document longer
    than the context is cut into lm-eval's windows (built here with lm-eval's own functions, with the
    window of Levanter's scorer: context - 1 predicted tokens), each window is scored alone from the
    logits, and the task's word and byte perplexities and bits per byte follow as lm-eval defines them:
    exp(-sum ll / sum words), exp(-sum ll / sum bytes), -sum ll / sum bytes / ln 2."""
    import math
    import re

    import equinox as eqx
    import haliax as hax
    import jax
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

    from qkvflow.evaluation import harness

    config, model, tokenizer, _ = run
    window = model.Pos.size - 1
    owners, seqs, starts = [], [], []  # every window alone, padded to the context (positions after it are unused)
    for i, text in enumerate(DOCS):
        ids = tokenizer.encode(text, add_special_tokens=False)
        windows = [
            make_disjoint_window(w)
            for w in get_rolling_token_windows(ids, tokenizer.eos_token_id, max_seq_len=window, context_len=1)
        ]
        assert sum(len(pred) for _, pred in windows) == len(ids)
        for context, pred in windows:
            owners.append(i)
            seqs.append(context + pred + [0] * (model.Pos.size - len(context) - len(pred)))
            starts.append((len(context), len(context) + len(pred)))
    Batch = hax.Axis("batch", len(seqs))
    logits = eqx.filter_jit(lambda m, x: m(x))(model, hax.named(np.asarray(seqs, np.int32), (Batch, model.Pos)))
    logp = np.asarray(jax.nn.log_softmax(np.asarray(logits.array, np.float64), axis=-1))
    reference = [0.0] * len(DOCS)
    for b, (owner, (lo, hi)) in enumerate(zip(owners, starts)):
        reference[owner] += sum(logp[b, j - 1, seqs[b][j]] for j in range(lo, hi))
    n_windows = [owners.count(i) for i in range(len(DOCS))]
    assert n_windows[0] >= 3 and n_windows[1] == 1  # the first document is longer than two contexts

    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in DOCS))
    task = tmp_path / "tiny_rolling.yaml"
    task.write_text(
        "task: qkvflow_tiny_rolling\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: docs.jsonl\n"
        "output_type: loglikelihood_rolling\ntest_split: test\ndoc_to_text: ''\ndoc_to_target: '{{text}}'\n"
        "metric_list:\n  - metric: word_perplexity\n  - metric: byte_perplexity\n  - metric: bits_per_byte\n"
    )
    spec = harness.task_spec(str(task))
    harness.preload(spec)
    out = harness.run(model, config, spec, log_samples=True)
    scored = {s["doc_id"]: s["resps"][0][0] for s in out["samples"]["qkvflow_tiny_rolling"]}
    # float32 forward passes of the packed and the single windows: sums of ~60 log-probs of ~7.6 nats
    np.testing.assert_allclose([scored[i] for i in range(len(DOCS))], reference, rtol=0, atol=5e-4)
    ll = sum(reference)
    words = sum(len(re.split(r"\s+", t)) for t in DOCS)
    nbytes = sum(len(t.encode("utf-8")) for t in DOCS)
    got = out["results"]["qkvflow_tiny_rolling"]
    np.testing.assert_allclose(got["word_perplexity,none"], math.exp(-ll / words), rtol=1e-5)
    np.testing.assert_allclose(got["byte_perplexity,none"], math.exp(-ll / nbytes), rtol=1e-5)
    np.testing.assert_allclose(got["bits_per_byte,none"], -ll / nbytes / math.log(2), rtol=1e-5)
