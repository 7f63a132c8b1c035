"""`qkvflow eval`: perplexity, bits per byte and the depth table of a trained tiny DiffEqFormer.

The checkpoint is the tiny ODE model of tests/configs/tiny_train.yaml (N = 2 Euler steps) trained 8
steps by `qkvflow train` (tests/finetune_utils.shared_setup, shared with the fine-tuning tests); its
metrics.jsonl holds the run's final `eval/loss`.
"""

import json
import math
from pathlib import Path

import numpy as np
import pytest

from qkvflow.cli import main as cli_main
from qkvflow.errors import UserError
from tests.finetune_utils import TINY_TRAIN, shared_setup
from tests.helpers import with_host_devices
from tests.timescale import limit

EPS32 = float(np.finfo(np.float32).eps)


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    return shared_setup(tmp_path_factory)


def _eval(capsys, corpora, checkpoint, *extra, config_path=TINY_TRAIN):
    rc = cli_main(
        ["eval", "--config_path", config_path, "--corpus.root", str(corpora), "--checkpoint", str(checkpoint), *extra]
    )
    out, err = capsys.readouterr()
    return rc, out, err


def _rows(out: str) -> list[list[str]]:
    return [
        [c.strip() for c in line.strip("|").split("|")]
        for line in out.splitlines()
        if line.startswith("| ") and "solver" not in line
    ]


@pytest.fixture(scope="module")
def depth_run(shared, tmp_path_factory):
    """`qkvflow eval --steps N/2,N --tolerances 1e-2 --output DIR` on the trained tiny run (N = 2: the grids
    1 and 2, which the tests read back): the JSON it wrote."""
    import contextlib
    import io

    corpora, pretrained = shared
    out_dir = tmp_path_factory.mktemp("eval") / "depth"
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        rc = cli_main([
            "eval", "--config_path", TINY_TRAIN, "--corpus.root", str(corpora), "--checkpoint", str(pretrained),
            "--steps", "N/2,N", "--tolerances", "1e-2", "--per_sequence", "true", "--output", str(out_dir),
        ])  # fmt: skip
    assert rc == 0
    return out_dir, json.loads((out_dir / "depth.json").read_text()), stdout.getvalue()


def test_at_the_trained_grid_eval_equals_the_runs_own_eval_loss(shared, depth_run):
    """Same evaluator, batches, loss and float32 program as the run's last evaluation: the two agree to
    float32 round-off of the mean over the tokens (a few ulp of the loss; 16 eps allows XLA to
    reorder the reductions of the two compilations)."""
    from qkvflow.runs.tracking import metrics_file, read_metrics

    corpora, pretrained = shared
    runs = pretrained.parent.parent / "runs"
    steps = read_metrics(metrics_file(str(runs), "tiny"))
    run_loss = [steps[s]["eval/loss"] for s in sorted(steps) if "eval/loss" in steps[s]][-1]
    trained = [r for r in depth_run[1]["rows"] if r["trained"]]
    assert [(r["solver"], r["steps"]) for r in trained] == [("euler", 2)]
    assert trained[0]["loss"] == pytest.approx(run_loss, rel=16 * EPS32, abs=0)
    assert trained[0]["perplexity"] == pytest.approx(math.exp(run_loss), rel=32 * EPS32)


def test_on_two_devices_eval_equals_the_runs_own_eval_loss(shared, tmp_path):
    """`qkvflow eval` on a mesh of two devices (found on an H100, where the loader's one-CPU batching met
    tag arrays committed to the GPU mesh): with 4 examples per device the evaluator scores the run's 8
    evaluation examples, and the loss equals the run's to round-off of a mean over 8 x 32 targets whose
    two per-device partial sums are added in another order (log2(256) = 8 eps per reassociation; 32 eps)."""
    import os

    from qkvflow.runs.tracking import metrics_file, read_metrics
    from tests import warm

    corpora, pretrained = shared
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=with_host_devices(2))
    out = tmp_path / "depth"
    proc = warm.run(
        ["eval", "--config_path", TINY_TRAIN, "--corpus.root", str(corpora), "--checkpoint", str(pretrained),
         "--trainer.per_device_eval_parallelism", "4", "--output", str(out)],
        env, cwd=tmp_path, timeout=limit(600),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps = read_metrics(metrics_file(str(pretrained.parent.parent / "runs"), "tiny"))
    run_loss = [steps[s]["eval/loss"] for s in sorted(steps) if "eval/loss" in steps[s]][-1]
    (row,) = json.loads((out / "depth.json").read_text())["rows"]
    assert row["loss"] == pytest.approx(run_loss, rel=32 * EPS32, abs=0)


def test_each_row_is_the_models_loss_at_its_grid_from_its_own_logits(shared, depth_run):
    """Reference from the definition: the mean over weighted positions of -log softmax(logits)[next
    token], with logits of the model at that grid, on the evaluator's batches; bpb = nats / (ln 2 bytes)."""
    import haliax as hax
    import jax
    import jax.numpy as jnp

    from qkvflow.cli import parse
    from qkvflow.cli.eval import EvalConfig
    from qkvflow.evaluation.depth import with_ode
    from qkvflow.evaluation.perplexity import make_evaluator
    from qkvflow.runs.corpus import with_corpus
    from qkvflow.runs.model import load_model

    corpora, pretrained = shared
    config = with_corpus(parse(EvalConfig, ["--config_path", TINY_TRAIN, "--corpus.root", str(corpora)], "eval"))
    model, _ = load_model(config, str(pretrained))
    t = config.trainer
    with hax.partitioning.set_mesh(t.device_mesh), hax.axis_mapping(t.parameter_axis_mapping):
        evaluator = make_evaluator(config, config.model.max_Pos, config.data.the_tokenizer)
        batches = [(np.asarray(b.tokens.array), np.asarray(b.loss_weight.array)) for b, _ in evaluator.loader]
    rows = depth_run[1]["rows"]
    fixed = [r for r in rows if r["tolerance"] is None]
    assert [r["steps"] for r in fixed] == [1, 2]
    for row in fixed:
        m = with_ode(model, config.model.ode.__class__(num_steps=row["steps"], solver="euler"))
        nats = tokens = 0.0
        for ids, w in batches:
            named = hax.named(jnp.asarray(ids), ("batch", config.model.max_Pos.name))
            logp = jax.nn.log_softmax(np.asarray(m(named).array, dtype=np.float64), axis=-1)
            target = np.roll(ids, -1, axis=-1)
            nll = -np.take_along_axis(np.asarray(logp), target[..., None], axis=-1)[..., 0]
            nats += float((nll * w).sum())
            tokens += float(w.sum())
        # float32 logits of a [vocab 2048] softmax: relative error of a few hundred eps at most
        assert row["loss"] == pytest.approx(nats / tokens, rel=256 * EPS32)
        assert row["tokens"] == tokens
        assert row["bpb"] == pytest.approx(row["loss"] * tokens / (math.log(2) * row["bytes"]), rel=1e-12)
        assert row["nfe"] == row["steps"]  # Euler: one evaluation per step
    assert fixed[0]["loss"] != fixed[1]["loss"]  # the grid was really changed


def test_adaptive_rows_count_the_evaluations_the_field_received(shared, depth_run, monkeypatch):
    """The tsit5 row's evaluations against a counter the model's own field bumps at run time (a host
    callback in the flavour's `vector_field`), batch by batch over the evaluator's batches: the count includes the
    re-evaluations of f(t0, y0) after a rejected first step, which 1 + 6 x steps misses (the CI run of
    2026-11-24 saw 110 = 2 + 6 x 18)."""
    import dataclasses

    import haliax as hax
    import jax
    from levanter.utils.tree_utils import inference_mode

    from qkvflow.cli import parse
    from qkvflow.cli.eval import EvalConfig
    from qkvflow.evaluation.depth import with_ode
    from qkvflow.evaluation.perplexity import make_evaluator
    from qkvflow.runs.corpus import with_corpus
    from qkvflow.runs.model import load_model

    adaptive = [r for r in depth_run[1]["rows"] if r["tolerance"] is not None]
    assert [(r["solver"], r["tolerance"]) for r in adaptive] == [("tsit5", 1e-2)]
    row = adaptive[0]

    corpora, pretrained = shared
    config = with_corpus(parse(EvalConfig, ["--config_path", TINY_TRAIN, "--corpus.root", str(corpora)], "eval"))
    model, _ = load_model(config, str(pretrained))
    base = config.model.ode
    # the documented rule: rtol = tolerance, atol = tolerance x (atol / rtol of the config)
    tsit5 = dataclasses.replace(base, solver="tsit5", adaptive=True, rtol=1e-2, atol=1e-2 * base.atol / base.rtol)
    model = inference_mode(with_ode(model, tsit5), True)
    field = model.field.vector_field

    def counted(*args, **kwargs):
        jax.debug.callback(lambda: calls.append(1))
        return field(*args, **kwargs)

    monkeypatch.setattr(model.field, "vector_field", counted)
    t = config.trainer
    evaluator = make_evaluator(config, config.model.max_Pos, config.data.the_tokenizer)  # outside the mesh, as eval
    counts = []
    with hax.partitioning.set_mesh(t.device_mesh), hax.axis_mapping(t.parameter_axis_mapping):
        model = hax.shard(model, t.parameter_axis_mapping)
        flow = hax.named_jit(lambda m, b: m.flow(b.tokens, b.attn_mask)[0], axis_resources=evaluator.axis_mapping)
        for batch, _tags in evaluator.loader:
            calls = []
            jax.block_until_ready(flow(model, batch).array)
            jax.effects_barrier()
            counts.append(len(calls))
    assert (row["nfe_min"], row["nfe_max"]) == (min(counts), max(counts))
    assert row["nfe"] == pytest.approx(np.mean(counts), rel=1e-12)
    assert min(counts) >= 7
    assert math.isfinite(row["loss"])
    # --per_sequence: every evaluated sequence solved alone (tests/evaluation/test_per_sequence.py checks the counts)
    spread = row["nfe_per_sequence"]
    assert spread["sequences"] == depth_run[1]["eval_examples"]
    assert spread["min"] <= spread["q10"] <= spread["q50"] <= spread["q90"] <= spread["max"]


def test_outputs_table_plot_and_overwrite_rules(shared, depth_run, capsys):
    out_dir, result, stdout = depth_run
    assert sorted(p.name for p in out_dir.iterdir()) == ["depth.json", "depth.md", "depth.png", "qkvflow_output.json"]
    table, spread = _rows(stdout)[:3], _rows(stdout)[3:]
    assert [r[:2] for r in table] == [["euler", "N=1"], ["euler", "N=2 (trained)"], ["tsit5", "tol=0.01"]]
    assert [r[:3] for r in spread] == [["tsit5", "tol=0.01", str(result["eval_examples"])]]  # the per-sequence table
    assert table[1][4] == f"{result['rows'][1]['perplexity']:.2f}"
    md = (out_dir / "depth.md").read_text().splitlines()  # the grid table, a blank line, the per-sequence table
    assert [line for line in md if line.startswith("|")] == [
        line for line in stdout.splitlines() if line.startswith("|")
    ]
    assert "" in md
    corpora, pretrained = shared
    rc, _, err = _eval(capsys, corpora, pretrained, "--output", str(out_dir))
    assert rc == 2 and "pass --overwrite" in err and len(err.strip().splitlines()) == 1
    foreign = out_dir.parent / "notours"
    foreign.mkdir()
    (foreign / "keep.txt").write_text("x")
    rc, _, err = _eval(capsys, corpora, pretrained, "--output", str(foreign))
    assert rc == 2 and "was not written by qkvflow" in err
    assert (foreign / "keep.txt").read_text() == "x"
    from qkvflow.runs.model import newest_step

    inside = Path(newest_step(str(pretrained))) / "eval"  # issue 56, item 4: not inside the run's folder
    rc, _, err = _eval(capsys, corpora, pretrained, "--output", str(inside))
    assert rc == 2 and "is inside the run folder of --checkpoint" in err and len(err.strip().splitlines()) == 1, err
    assert not inside.exists()


def test_steps_auto_marks_the_fewest_evaluations_within_the_tolerance(shared, depth_run, capsys, tmp_path):
    """`--steps auto` scores each candidate grid as --steps does (N = 1 and 2 equal the depth table's rows)
    and marks the grid with the fewest evaluations among those within --auto_tolerance of the lowest loss,
    worked out here from the rows it wrote."""
    corpora, pretrained = shared
    out_dir, tolerance = tmp_path / "auto", 0.02
    rc, out, err = _eval(capsys, corpora, pretrained, "--steps", "auto", "--auto_grids", "4,1,2",
                         "--auto_tolerance", str(tolerance), "--output", str(out_dir))  # fmt: skip
    assert rc == 0, err
    result = json.loads((out_dir / "depth.json").read_text())
    rows = result["rows"]
    assert [(r["solver"], r["steps"], r["nfe"]) for r in rows] == [("euler", 4, 4), ("euler", 1, 1), ("euler", 2, 2)]
    earlier = {r["steps"]: r["loss"] for r in depth_run[1]["rows"] if r["tolerance"] is None}
    for row in rows[1:]:
        assert row["loss"] == pytest.approx(earlier[row["steps"]], rel=16 * EPS32, abs=0)
    lowest = min(r["loss"] for r in rows)
    expected = min((r for r in rows if r["loss"] <= lowest + tolerance), key=lambda r: r["nfe"])
    assert [r["steps"] for r in rows if r.get("auto")] == [expected["steps"]]
    assert result["auto"]["chosen"]["steps"] == expected["steps"]
    assert result["auto"]["best"]["loss"] == lowest and result["auto"]["tolerance"] == tolerance
    printed = [line for line in out.splitlines() if line.startswith("steps auto:")]
    assert printed == [result["auto"]["summary"]] and f"euler N={expected['steps']} " in printed[0]
    marked = [line for line in out.splitlines() if "(auto)" in line]
    assert len(marked) == 1 and f"N={expected['steps']}" in marked[0]
    assert result["auto"]["summary"] in (out_dir / "depth.md").read_text()


def test_steps_auto_chooses_on_one_split_and_reports_on_another(shared, capfd, tmp_path):
    """`--auto_split selection --corpus.eval_split test`: the candidates are scored on the selection half, the
    choice follows those scores (the rule worked out here), and the table's rows are the test half's.
    (capfd: building a split's Levanter cache enables faulthandler on stderr, which needs a real file.)"""
    corpora, pretrained = shared
    out_dir, tolerance = tmp_path / "auto", 0.02
    rc, out, err = _eval(capfd, corpora, pretrained, "--steps", "auto", "--auto_grids", "1,2", "--auto_tolerance",
                         str(tolerance), "--auto_split", "selection", "--corpus.eval_split", "test", "--output", str(out_dir))  # fmt: skip
    assert rc == 0, err
    result = json.loads((out_dir / "depth.json").read_text())
    scores, rows = result["auto"]["scores"], result["rows"]
    assert (
        [(r["solver"], r["steps"]) for r in scores]
        == [(r["solver"], r["steps"]) for r in rows]
        == [("euler", 1), ("euler", 2)]
    )
    assert all(a["loss"] != b["loss"] for a, b in zip(scores, rows))  # other documents
    lowest = min(r["loss"] for r in scores)
    expected = min((r for r in scores if r["loss"] <= lowest + tolerance), key=lambda r: r["nfe"])
    assert result["auto"]["chosen"] == expected and result["auto"]["split"] == "selection"
    assert [r["steps"] for r in rows if r.get("auto")] == [expected["steps"]]
    assert f"loss {expected['loss']:.4f} on the selection split)" in result["auto"]["summary"]
    assert result["auto"]["summary"] in out


@pytest.mark.parametrize(
    "args, message",
    [
        (["--steps", "2,x"], "--steps '2,x' is invalid: expected comma-separated integers"),
        (["--steps", "0"], "--steps 0 is invalid"),
        (["--steps", "N/3"], "--steps N/3 is invalid with the trained N=2: 1 x 2 / 3 is not a whole number"),
        (["--solver", "rk5"], "--solver rk5 is invalid"),
        (["--tolerances", "1e-2", "--adaptive_solver", "euler"], "--adaptive_solver euler is invalid"),
        (["--per_sequence", "true"], "--per_sequence: needs --tolerances"),
        (["--auto_tolerance", "0.1"], "--auto_tolerance: only with --steps auto"),
        (["--auto_split", "test"], "--auto_split: only with --steps auto"),
        (
            ["--steps", "auto", "--auto_split", "train"],
            "--auto_split 'train' is invalid: expected one of validation, selection, test",
        ),
        (["--steps", "auto", "--auto_tolerance", "-1"], "--auto_tolerance -1.0 is invalid: expected a number of nats"),
        (["--steps", "auto", "--auto_grids", "N/3"], "--auto_grids N/3 is invalid with the trained N=2"),
        # issue 56, items 6 and 8: before the model is loaded (lm-eval then found no documents after it)
        (["--tasks", "T.yaml", "--max_examples", "0"], "--max_examples 0 is invalid: expected an integer >= 1"),
        (["--max_examples", "3"], "--max_examples: only with --tasks"),
        (["--tasks", ","], "--tasks ',' is invalid: expected comma-separated task names or task YAML files"),
        (["--tasks=a,,b"], "--tasks 'a,,b' is invalid: expected comma-separated task names"),
    ],
)
def test_bad_grids_are_refused_in_one_line(shared, capsys, args, message):
    corpora, pretrained = shared
    rc, out, err = _eval(capsys, corpora, pretrained, *args)
    assert rc == 2 and message in err and len(err.strip().splitlines()) == 1, err


def test_steps_relative_to_the_trained_grid():
    from qkvflow.evaluation.depth import parse_steps

    assert parse_steps("N/4,N/2,N,2N,4N", 8) == [2, 4, 8, 16, 32]
    assert parse_steps("3, 2*N, 5", 4) == [3, 8, 5]
    for bad in ("N/16", "N/0", "xN", "2.5", "N/2.0"):
        with pytest.raises(UserError):
            parse_steps(bad, 8)


def test_target_bytes_decode_each_run_of_targets_as_utf8():
    """Bytes of the target text: a hand-made tokenizer of one character per id, with multi-byte
    characters; position i's weight is for token i + 1, so the first token is never a target."""
    from qkvflow.evaluation.perplexity import target_bytes

    chars = ["<eos>", "a", "é", "€", " ", "𝄞"]

    class Chars:
        def decode(self, ids, skip_special_tokens=False):
            return "".join(chars[i] for i in ids if not (skip_special_tokens and i == 0))

    tokens = np.array([[1, 2, 3, 0, 4, 5], [5, 5, 1, 1, 2, 2]])
    weights = np.array([[1, 1, 1, 1, 1, 0], [0, 1, 1, 0, 1, 0]])
    # row 0 targets: é € <eos> ' ' 𝄞 -> 2 + 3 + 0 + 1 + 4; row 1 targets (positions 1, 2 and 4): a a | é
    assert target_bytes(tokens, weights, Chars()) == (2 + 3 + 0 + 1 + 4) + (1 + 1) + 2
