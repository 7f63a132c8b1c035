"""`qkvflow finetune`: a pretrained DiffEqFormer, discretised at M layers, fine-tuned with LoRA or fully.

The end-to-end run here (LoRA at M = 2N, in this process so that the final model can be inspected)
checks that the loss falls, that the frozen base is bit-identical to the discretised checkpoint and
the adapters changed, and that the PEFT adapter on the exported base computes the Levanter model's
logits in torch. Full fine-tuning runs at M = N/2 with a stop, a resume and the Hugging Face export;
the 2 x 2 grid of tests/test_sweep.py (slow) runs both methods at both depths.
"""

import json
import math
from pathlib import Path

import numpy as np
import pytest

from qkvflow.cli import main as cli_main
from tests.finetune_utils import TINY_FINETUNE, TINY_TRAIN, base_args, save_fresh_checkpoint, shared_setup, url_data
from tests.train_utils import losses


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    return shared_setup(tmp_path_factory)


LORA_LR = "1e-2"
MIN_DROP = 0.005


def _parse(tmp_path, corpora, pretrained, *extra):
    from qkvflow.finetune.run import FinetuneConfig
    from tests.helpers import parse_config

    args = base_args(tmp_path, corpora, pretrained)[2:] + list(extra)
    return parse_config(TINY_FINETUNE, FinetuneConfig, args)


REPEATED = (
    "The assert statement is a convenient way to insert debugging assertions into a program. "
    "The simple form evaluates an expression and raises an error when it is false. "
) * 3


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory, shared):
    """LoRA at M = 2N = 4 on a small repetitive text (train = validation), so that six steps show
    a clear effect; the tokenizer is the pretraining corpus's."""
    from qkvflow.finetune.run import finetune

    corpora, pretrained = shared
    workdir = tmp_path_factory.mktemp("lora")
    data = workdir / "small.jsonl"
    data.write_text("".join(json.dumps({"text": REPEATED}) + "\n" for _ in range(48)))
    export = f"{{hf_dir: {workdir / 'hf'}, peft_dir: {workdir / 'peft'}, merged: false}}"
    config = _parse(
        workdir, corpora, pretrained, "--steps", "4", "--export", export,
        *url_data(data, corpora / "pydoc" / "tokenizer", workdir / "cache"),
        "--optimizer.learning_rate", LORA_LR,
    )  # fmt: skip
    return workdir, config, finetune(config)


def test_lora_loss_falls_and_summary(lora_run):
    workdir, config, summary = lora_run
    curve = losses(workdir, "tiny-ft")
    assert len(curve) == 6 and curve[-1] < curve[0] - MIN_DROP, curve
    assert summary["eval_loss"] < summary["initial_eval_loss"] - MIN_DROP, summary
    assert summary["finished"] and summary["steps"] == 6
    assert summary["steps_M"] == 4 and summary["pretrained_steps_N"] == 2
    # LoRA r=4 on q, k, v, o (32 -> 32) and up, down (32 <-> 128) in each of the 4 layers
    assert summary["trainable_parameter_count"] == 4 * (4 * 4 * 64 + 2 * 4 * 160)
    assert summary["eval_perplexity"] == pytest.approx(math.exp(summary["eval_loss"]), rel=1e-6)
    written = json.loads((workdir / "checkpoints" / "tiny-ft" / "finetune_summary.json").read_text())
    assert written["finished"] and written["eval_loss"] == summary["eval_loss"] and "model" not in written
    assert (workdir / "checkpoints" / "tiny-ft" / "step-6").is_dir()  # after step 6
    assert (workdir / "runs" / "tiny-ft" / "loss_curve.png").stat().st_size > 10_000


def test_lora_freezes_the_base_bit_for_bit_and_trains_the_adapters(lora_run, shared):
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    from levanter.adaptor.lora import partition_lora_params

    from qkvflow.runs.finetune_config import load_pretrained_config
    from qkvflow.runs.model import add_lora, load_base

    _, config, summary = lora_run
    from qkvflow.runs.corpus import with_corpus

    c = with_corpus(config)
    tokenizer = c.data.the_tokenizer
    from haliax import Axis

    base = load_base(c, load_pretrained_config(c), tokenizer, Axis("vocab", len(tokenizer)))
    initial = add_lora(base, config.lora, config.lora_seed)
    base_before, lora_before = partition_lora_params(initial)
    base_after, lora_after = partition_lora_params(summary["model"])
    before, after = jax.tree_util.tree_leaves(base_before), jax.tree_util.tree_leaves(base_after)
    assert len(before) == len(after) > 10
    for x, y in zip(before, after):
        assert x.dtype == y.dtype and bool(jnp.array_equal(x, y))
    arrays = lambda tree: [x for x in jax.tree_util.tree_leaves(tree) if eqx.is_array(x)]  # noqa: E731
    a_b_before, a_b_after = arrays(lora_before), arrays(lora_after)
    assert len(a_b_before) == 2 * 6  # lora_A and lora_B of q, k, v, o, up, down (stacked over the layers)
    assert all(not bool(jnp.array_equal(x, y)) for x, y in zip(a_b_before, a_b_after))
    assert all(not bool(jnp.any(b)) for b in a_b_before[1::2])  # B starts at 0: training starts from the base

    # export.merged: the adapters merged into the base compute the fine-tuned model
    import haliax as hax

    from qkvflow.runs.model import merged_model

    merged = merged_model(summary["model"], base, config.lora, config.lora_seed)
    tokens = hax.named(jnp.arange(32, dtype=jnp.int32) % 97, "position")
    want, got = summary["model"](tokens).array, merged(tokens).array
    assert type(merged) is type(base) and bool(jnp.allclose(got, want, rtol=1e-4, atol=1e-4))
    assert not bool(jnp.allclose(base(tokens).array, want, rtol=1e-4, atol=1e-4))


def test_peft_adapter_on_the_exported_base_computes_the_fine_tuned_model(lora_run):
    import haliax as hax
    import jax.numpy as jnp
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    workdir, _, summary = lora_run
    adapter = json.loads((workdir / "peft" / "tiny-ft" / "adapter_config.json").read_text())
    assert adapter["r"] == 4 and adapter["lora_alpha"] == 8.0
    assert sorted(adapter["target_modules"]) == ["down_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]
    base = AutoModelForCausalLM.from_pretrained(str(workdir / "hf" / "tiny-ft"), trust_remote_code=True)
    model = PeftModel.from_pretrained(base, str(workdir / "peft" / "tiny-ft")).eval()
    tokens = np.random.default_rng(0).integers(0, 500, size=32)
    with torch.no_grad():
        got = model(torch.tensor(tokens)[None]).logits[0].numpy()
        plain = model.get_base_model()
        with model.disable_adapter():
            without = plain(torch.tensor(tokens)[None]).logits[0].numpy()
    want = summary["model"](hax.named(jnp.asarray(tokens, dtype=jnp.int32), "position")).array
    want = np.asarray(want)[:, : got.shape[-1]]
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    assert np.abs(got - without).max() > 1e-3  # the adapter matters


def test_full_fine_tune_resumes_and_exports_the_fine_tuned_model(tmp_path, shared):
    """`finetune: full` end to end in this process, on the sweep's settings (`merged: false`, as in
    quickstart_lora.yaml, whose sweep runs lora and full): stop after step 1, resume, finish, export.
    The resumed summary keeps the validation loss measured before fine-tuning; each step's metrics
    appear once in metrics.jsonl; the Hugging Face export is complete, loads in transformers and
    computes the fine-tuned JAX model's logits (to float32 round-off)."""
    import haliax as hax
    import jax.numpy as jnp
    import torch
    from transformers import AutoModelForCausalLM

    from qkvflow.finetune.run import finetune

    corpora, pretrained = shared
    args = (
        "--finetune", "full", "--steps", "1", "--trainer.num_train_steps", "2", "--loss_curve", "null",
        "--export", f"{{hf_dir: {tmp_path / 'hf'}, merged: false}}",
    )  # fmt: skip
    first = finetune(_parse(tmp_path, corpora, pretrained, *args, "--stop_after", "1"))
    assert not first["finished"] and first["steps"] == 1 and "hf_dir" not in first
    summary = finetune(_parse(tmp_path, corpora, pretrained, *args))
    assert summary["finished"] and summary["steps"] == 2
    written = json.loads((tmp_path / "checkpoints" / "tiny-ft" / "finetune_summary.json").read_text())
    for got in (summary, written):  # what `qkvflow sweep` tabulates
        assert got["initial_eval_loss"] == first["initial_eval_loss"]
        assert got["train_loss"] == summary["train_loss"] and got["eval_loss"] == summary["eval_loss"]

    records = [json.loads(line) for line in (tmp_path / "runs" / "tiny-ft" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["event"] == "log" and "train/loss" in r["metrics"]] == [0, 1]
    # run again when finished: nothing trained, and no step, evaluation or summary record appended (only
    # Levanter's record of the start's hyperparameters); the summary is the finished run's
    again = finetune(_parse(tmp_path, corpora, pretrained, *args))
    assert again["nothing_to_train"] and again["eval_loss"] == summary["eval_loss"]
    kept = [json.loads(line) for line in (tmp_path / "runs" / "tiny-ft" / "metrics.jsonl").read_text().splitlines()]
    assert [r for r in kept if r["event"] in ("log", "summary")] == [
        r for r in records if r["event"] in ("log", "summary")
    ]

    hf = tmp_path / "hf" / "tiny-ft"
    assert summary["hf_dir"] == str(hf) and (hf / "model.safetensors").is_file()
    model = AutoModelForCausalLM.from_pretrained(str(hf), trust_remote_code=True).eval()
    tokens = np.random.default_rng(0).integers(0, 500, size=32)
    with torch.no_grad():
        got = model(torch.tensor(tokens)[None]).logits[0].numpy()
    want = np.asarray(summary["model"](hax.named(jnp.asarray(tokens, dtype=jnp.int32), "position")).array)
    np.testing.assert_allclose(got, want[:, : got.shape[-1]], rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_lora_stop_and_resume_reproduces_the_uninterrupted_run(lora_run, shared, tmp_path):
    """Under LoRA the checkpoints hold only the adapters and their optimizer state; a resume
    rebuilds the frozen base from the ODE checkpoint and continues exactly."""
    from tests.finetune_utils import run_cli

    whole, config, _ = lora_run
    corpora, pretrained = shared
    data = whole / "small.jsonl"
    args = [
        *base_args(tmp_path, corpora, pretrained), "--steps", "4",
        *url_data(data, corpora / "pydoc" / "tokenizer", whole / "cache"),
        "--optimizer.learning_rate", LORA_LR,
    ]  # fmt: skip
    first = run_cli("finetune", tmp_path, *args, "--stop_after", "3")
    assert first.returncode == 0 and "step 3/6" in first.stdout and "step 4/6" not in first.stdout, first.stderr[-3000:]
    assert not json.loads((tmp_path / "checkpoints" / "tiny-ft" / "finetune_summary.json").read_text())["finished"]
    assert "== qkvflow finetune: stopped after step 3 of 6 (stop_after 3); run the same command without" in first.stdout
    second = run_cli("finetune", tmp_path, *args)
    assert second.returncode == 0 and "resuming run tiny-ft after step 3" in second.stdout, second.stderr[-3000:]
    assert "== qkvflow finetune: done ==" in second.stdout
    assert losses(tmp_path, "tiny-ft") == losses(whole, "tiny-ft")


def _fails(capsys, argv, message):
    assert cli_main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert message in err, err
    assert "\n" not in err and "Traceback" not in err
    return err


@pytest.mark.parametrize(
    "extra,message",
    [
        (["--steps", "0"], "steps=0 is invalid: expected an integer >= 1"),
        (["--finetune", "qlora"], "finetune='qlora' is invalid: expected one of lora, full"),
        (["--solver", "rk4"], "solver='rk4' is invalid"),
        (["--lora.r", "0"], "lora.r=0 is invalid"),
        (["--pretrained.config_path", "configs/paper/owt_small_gpt2.yaml"], "steps=4 is invalid for pretrained"),
        (
            ["--pretrained.config_path", "configs/paper/owt_small_gpt2.yaml", "--steps", "12"],
            "holds a DiffEqFormer model but pretrained.config_path='configs/paper/owt_small_gpt2.yaml' describes",
        ),
        (["--pretrained.checkpoint", "{tmp}/nothing"], "pretrained.checkpoint='{tmp}/nothing': no checkpoint found"),
    ],
    ids=["steps", "method", "solver", "lora-rank", "baseline-depth", "baseline-config", "no-checkpoint"],
)
def test_bad_input_fails_in_one_line(tmp_path, shared, capsys, extra, message, monkeypatch):
    from tests.finetune_utils import ROOT

    monkeypatch.chdir(ROOT)
    corpora, pretrained = shared
    extra = [e.format(tmp=tmp_path) for e in extra]
    _fails(capsys, ["finetune", *base_args(tmp_path, corpora, pretrained), *extra], message.format(tmp=tmp_path))
    assert not (tmp_path / "checkpoints").exists()


def test_a_baseline_checkpoint_is_refused(tmp_path, shared, baseline, capsys):
    """A Levanter GPT-2 (baseline) checkpoint given as the ODE run's checkpoint."""
    corpora, _ = shared
    _, checkpoint = baseline
    err = _fails(capsys, ["finetune", *base_args(tmp_path, corpora, checkpoint)], "does not hold a DiffEqFormer model")
    assert "pretrained.checkpoint=" in err


def test_a_pretrained_model_of_another_shape_is_refused_without_a_trace(tmp_path, shared, capsys):
    """pretrained.config_path describes a wider model than the checkpoint holds: refused in one line
    naming the array, before the run writes anything (no checkpoints/<id>, no runs/<id>/metrics.jsonl)."""
    from tests.finetune_utils import TINY_TRAIN

    corpora, pretrained = shared
    wider = tmp_path / "wider.yaml"
    wider.write_text(Path(TINY_TRAIN).read_text().replace("hidden_dim: 32", "hidden_dim: 64", 1))
    args = [*base_args(tmp_path, corpora, pretrained), "--pretrained.config_path", str(wider)]
    _fails(capsys, ["finetune", *args], "pretrained.checkpoint")
    assert not (tmp_path / "checkpoints").exists() and not (tmp_path / "runs").exists()


BASELINE = {
    "type": "gpt2",
    "num_layers": 2,
    "hidden_dim": 32,
    "num_heads": 2,
    "max_seq_len": 32,
    "initializer_range": 0.3,
}


@pytest.fixture(scope="module")
def baseline(tmp_path_factory, shared):
    """(config path, checkpoint) of a tiny Levanter GPT-2 (a discrete baseline), initialised with another
    key than a fresh build would use, so that fine-tuning a fresh model instead of the checkpoint shows."""
    import yaml

    corpora, _ = shared
    workdir = tmp_path_factory.mktemp("baseline")
    config = yaml.safe_load(open(TINY_TRAIN))
    config["model"] = BASELINE
    path = workdir / "baseline.yaml"
    path.write_text(yaml.safe_dump(config))
    return str(path), save_fresh_checkpoint(workdir / "baseline", corpora, str(path), seed=7)


def test_a_baseline_is_fine_tuned_as_it_is_at_its_own_depth(tmp_path, shared, baseline):
    """Fig. 6's GPT side: a baseline checkpoint is fine-tuned (LoRA) without discretisation. The frozen
    base is the checkpoint's model bit for bit, the adapters sit on GPT-2's four projections, and the
    summary names the depth."""
    import jax
    import jax.numpy as jnp
    from levanter.adaptor.lora import partition_lora_params

    from qkvflow.finetune.run import FinetuneConfig, finetune
    from qkvflow.runs.config import TrainConfig
    from qkvflow.runs.model import load_model
    from tests.helpers import parse_config

    corpora, _ = shared
    config_path, checkpoint = baseline
    args = base_args(tmp_path, corpora, checkpoint)[2:]
    args += ["--pretrained.config_path", config_path, "--steps", "2", "--trainer.num_train_steps", "2"]
    summary = finetune(parse_config(TINY_FINETUNE, FinetuneConfig, args))
    assert summary["finished"] and not summary["pretrained_ode"]
    assert summary["steps_M"] == summary["pretrained_steps_N"] == 2
    # LoRA r=4 per layer on c_attn (32 -> 3 x 32), attn c_proj (32 -> 32), c_fc (32 -> 128), mlp c_proj (128 -> 32)
    assert summary["trainable_parameter_count"] == 2 * 4 * ((32 + 96) + (32 + 32) + (32 + 128) + (128 + 32))

    train = parse_config(config_path, TrainConfig, ["--corpus.root", str(corpora)])
    want, _ = load_model(train, str(checkpoint))
    base_after, _ = partition_lora_params(summary["model"])
    want, got = jax.tree_util.tree_leaves(want), jax.tree_util.tree_leaves(base_after)
    assert len(want) == len(got) > 10
    assert all(bool(jnp.array_equal(x, y)) for x, y in zip(want, got))


@pytest.mark.parametrize(
    "extra,message",
    [
        (["--steps", "3"], "steps=3 is invalid for pretrained.config_path="),
        (["--steps", "2", "--export.hf_dir", "{tmp}/hf"], "export is not supported for the Gpt2Config"),
    ],
    ids=["depth", "export"],
)
def test_a_baseline_at_another_depth_or_with_an_export_is_refused(tmp_path, shared, baseline, capsys, extra, message):
    corpora, _ = shared
    config_path, checkpoint = baseline
    args = [*base_args(tmp_path, corpora, checkpoint), "--pretrained.config_path", config_path]
    err = _fails(capsys, ["finetune", *args, *[e.format(tmp=tmp_path) for e in extra]], message)
    assert "num_layers=2" in err or "export" in err
    assert not (tmp_path / "checkpoints").exists()
