"""`qkvflow eval` on checkpoints of fixed depth: Levanter's GPT-2 baseline as `qkvflow train` builds it."""

import pytest

from qkvflow.cli import main as cli_main
from tests.finetune_utils import save_fresh_checkpoint

GPT2_YAML = """corpus:
  name: pydoc
  root: {root}
model:
  type: gpt2
  max_seq_len: 32
  hidden_dim: 32
  num_heads: 2
  num_layers: 3
trainer:
  max_eval_batches: 1
  per_device_eval_parallelism: 8
  mp: p=f32,c=f32
"""


@pytest.fixture(scope="module")
def gpt2_run(tmp_path_factory, corpus_root):
    folder = tmp_path_factory.mktemp("gpt2")
    config = folder / "gpt2.yaml"
    config.write_text(GPT2_YAML.format(root=corpus_root))
    return str(config), str(save_fresh_checkpoint(folder / "ckpt", corpus_root, str(config)))


def test_a_baseline_is_evaluated_and_refuses_solver_grids(gpt2_run, capfd):
    import math

    config, checkpoint = gpt2_run
    assert cli_main(["eval", "--config_path", config, "--checkpoint", checkpoint]) == 0
    rows = [line for line in capfd.readouterr().out.splitlines() if line.startswith("| -")]
    assert len(rows) == 1 and "| 3 layers (trained) |" in rows[0]
    loss = float(rows[0].split("|")[4])
    assert abs(loss - math.log(2048)) < 0.5  # a fresh model is close to uniform over the 2,048 tokens
    for flag, value in (("--steps", "2,4"), ("--solver", "rk4"), ("--tolerances", "1e-3")):
        assert cli_main(["eval", "--config_path", config, "--checkpoint", checkpoint, flag, value]) == 2
        err = capfd.readouterr().err.strip()
        assert (
            err
            == f"qkvflow eval: error: {flag}: model.type=gpt2 has a fixed depth; solver grids apply to DiffEqFormer checkpoints"
        )


def test_a_finetune_config_without_its_pretrained_checkpoint_is_refused_in_one_line(gpt2_run, capfd):
    """A `qkvflow finetune` config is evaluated as its run's model (tests/evaluation/test_finetuned.py),
    rebuilt from the pretrained checkpoint it names: here absent (the config's relative default)."""
    from tests.finetune_utils import TINY_FINETUNE

    assert cli_main(["eval", "--config_path", TINY_FINETUNE, "--checkpoint", gpt2_run[1]]) == 2
    err = capfd.readouterr().err.strip()
    assert "pretrained.checkpoint='checkpoints/tiny': no checkpoint found" in err and len(err.splitlines()) == 1


def test_a_checkpoint_of_the_other_variant_names_model_variant(tmp_path, corpus_root, capfd):
    """A `variant: official` checkpoint evaluated with qkvflow's variant, and the reverse: one line that
    names the config key and the value to pass, before any evaluation (issue 56, item 8)."""
    from tests.finetune_utils import TINY_TRAIN

    official = save_fresh_checkpoint(tmp_path / "official", corpus_root, TINY_TRAIN, "--model.variant", "official")
    ours = save_fresh_checkpoint(tmp_path / "qkvflow", corpus_root, TINY_TRAIN)
    base = ["eval", "--config_path", TINY_TRAIN, "--corpus.root", str(corpus_root)]
    for checkpoint, given, stored in ((official, [], "official"), (ours, ["--model.variant", "official"], "qkvflow")):
        capfd.readouterr()
        assert cli_main([*base, "--checkpoint", str(checkpoint), *given]) == 2
        err = capfd.readouterr().err.strip().splitlines()
        assert len(err) == 1, err
        configured = "qkvflow" if stored == "official" else "official"
        assert (
            f"holds a model of model.variant={stored!r} but the config has model.variant={configured!r}: "
            f"pass --model.variant {stored}"
        ) in err[0], err
