"""Every shipped YAML parses into a TrainConfig (or its FinetuneConfig) and its model builds (shapes only),
and the paper's configs pair up with their baselines.

No data is read, no tokenizer loaded, nothing downloaded, no array allocated.
"""

import dataclasses
import json
import os
from pathlib import Path

import pytest
from levanter.data.text import HfDatasetSourceConfig
from levanter.models.gpt2 import Gpt2Config
from levanter.models.llama import LlamaConfig

from qkvflow.cli.describe import DescribeConfig, describe
from qkvflow.cli.describe import main as describe_main
from qkvflow.data.heldout import HeldOutHfDatasetSourceConfig
from qkvflow.finetune.run import FinetuneConfig
from qkvflow.models.diffeqformer import DiffEqFormerGpt2Config, DiffEqFormerLlamaConfig
from qkvflow.runs.config import TrainConfig
from qkvflow.training.adam import with_decay_mask
from tests.helpers import config_class, parse_config

ROOT = Path(__file__).resolve().parents[1]
ALL_YAML = sorted(p for d in ("configs", "tests/configs") for p in (ROOT / d).rglob("*.yaml"))
PAPER = ROOT / "configs" / "paper"
# (ODE config, baseline config, baseline model class, ODE model class)
PAIRS = [
    (f"{setting}_ode", f"{setting}_{base}", base_cls, ode_cls)
    for setting, base, base_cls, ode_cls in [
        ("wikitext103_small", "gpt2", Gpt2Config, DiffEqFormerGpt2Config),
        ("wikitext103_medium", "gpt2", Gpt2Config, DiffEqFormerGpt2Config),
        ("owt_small", "gpt2", Gpt2Config, DiffEqFormerGpt2Config),
        ("owt_medium", "gpt2", Gpt2Config, DiffEqFormerGpt2Config),
        ("owt_large", "gpt2", Gpt2Config, DiffEqFormerGpt2Config),
        ("owt_llama_1b", "llama", LlamaConfig, DiffEqFormerLlamaConfig),
    ]
]

# The authors' recipe (SDML-KU/qkvflow: config/owt/*.yaml, config/wikitext_103/*.yaml, train_lm.py, and
# Levanter 1.1's OptimizerConfig defaults for what they leave unset), written out from their files:
# setting: (d_emb, steps, batch, steps_per_eval, peak lr, Adam epsilon)
OFFICIAL = {
    "owt_small": (20, 20000, 512, 200, 6e-4, 1e-8),
    "owt_medium": (96, 40001, 256, 500, 3e-4, 1e-8),
    "owt_large": (96, 40001, 256, 500, 3e-4, 1e-6),
    "wikitext103_small": (20, 10001, 256, 200, 6e-4, 1e-8),
    "wikitext103_medium": (48, 10001, 256, 200, 3e-4, 1e-8),
}

parse = parse_config  # `path` and the overrides `args`, read as the verb that takes `cls` reads them


def paper(name: str) -> TrainConfig:
    return parse(PAPER / f"{name}.yaml")


@pytest.mark.parametrize("path", ALL_YAML, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_yaml_parses(path: Path) -> None:
    cls = config_class(path)
    config = parse(path, cls)
    assert isinstance(config, cls) and isinstance(config, TrainConfig)
    assert (cls is FinetuneConfig) == ("finetune" in path.name or path.parent.name == "finetune")


@pytest.mark.parametrize("path", ALL_YAML, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_yaml_builds(path: Path) -> None:
    """The model a config describes builds (abstractly: shapes, no memory), and its trainer.mesh lays out
    over 4 devices with the paper's 2-way tensor parallelism when the config shards over a model axis.
    A fine-tuning config builds its pretrained config's model."""
    import equinox as eqx
    import jax.random as jrandom
    from haliax import Axis

    config = parse(path, config_class(path))
    if isinstance(config, FinetuneConfig):
        config = parse(ROOT / config.pretrained.config_path, TrainConfig, config.pretrained.overrides)
    shapes = eqx.filter_eval_shape(lambda: config.model.build(Axis("vocab", 1024), key=jrandom.PRNGKey(0)))
    assert shapes.Pos.size == config.model.max_seq_len
    mesh = config.trainer.mesh
    assert mesh.axis_shapes(4, 1)[0] == {**{a: 1 for a in mesh.axes}, "data": 4}
    assert dict(mesh.axes) == {"data": -1, "replica": 1, "model": 1}


def test_every_paper_config_is_in_a_pair() -> None:
    listed = {name for ode, base, _, _ in PAIRS for name in (ode, base)} | {f"{s}_official" for s in OFFICIAL}
    assert {p.stem for p in PAPER.glob("*.yaml")} == listed


@pytest.mark.parametrize("ode_name, base_name, base_cls, ode_cls", PAIRS, ids=[p[0] for p in PAIRS])
def test_paper_pair_matches(ode_name: str, base_name: str, base_cls, ode_cls) -> None:
    ode, base = paper(ode_name), paper(base_name)
    assert type(ode.model) is ode_cls and type(base.model) is base_cls
    assert ode.model.ode.num_steps == base.model.num_layers
    assert ode.model.ode.solver == "euler" and ode.model.ode.checkpoints == 5
    for key in ("max_seq_len", "hidden_dim", "num_heads"):
        assert getattr(ode.model, key) == getattr(base.model, key), key
    if base_cls is LlamaConfig:
        assert ode.model.mlp_dim == base.model.intermediate_dim
    else:
        assert base.model.embed_pdrop == base.model.resid_pdrop == base.model.attn_pdrop == 0.1

    assert ode.data == base.data
    assert dataclasses.replace(ode.trainer, id=base.trainer.id) == base.trainer
    assert ode.trainer.id == ode_name and base.trainer.id == base_name
    assert ode.trainer.train_batch_size == 256
    assert ode.optimizer.beta2 == 0.95
    assert dataclasses.replace(ode.optimizer, beta2=base.optimizer.beta2) == base.optimizer

    assert ode.trainer.mesh.param_mapping == {"embed": "data"}  # Levanter 1.2's fsdp_axis: embed
    assert ode.trainer.mesh.shared_mapping == {"mlp": "model", "heads": "model"}  # tensor_parallel_axes
    ((name, component),) = ode.data.components.items()
    source = component.source
    if ode_name.startswith("owt"):
        assert isinstance(source, HeldOutHfDatasetSourceConfig)
        assert (source.id, source.validation_fraction) == ("Skylion007/openwebtext", 0.0005)
        assert ode.trainer.num_train_steps == 40000
    else:
        assert type(source) is HfDatasetSourceConfig  # the dataset's own validation split, nothing held out
        assert source.id == "dlwh/wikitext_103_detokenized"
        assert ode.trainer.num_train_steps == 10000


@pytest.mark.parametrize("setting", sorted(OFFICIAL))
def test_the_authors_recipe_configs(setting: str) -> None:
    """`*_official.yaml`: the paper config's model and data with the authors' generator, dropout and
    optimizer, and weight decay on the two embeddings alone."""
    from tests.test_weight_decay import paths_and_flags

    d_emb, steps, batch, every, lr, eps = OFFICIAL[setting]
    ours, ode = paper(f"{setting}_official"), paper(f"{setting}_ode")
    model = ours.model
    assert type(model) is DiffEqFormerGpt2Config and model.variant == "official"
    assert model.resolved_time_grid == "right" and model.time_embed_dim == d_emb
    assert model.embed_pdrop == model.resid_pdrop == 0.1 and ode.model.embed_pdrop == ode.model.resid_pdrop == 0.0
    assert dataclasses.replace(model, variant="qkvflow", time_embed_dim=ode.model.time_embed_dim,
                               embed_pdrop=0.0, resid_pdrop=0.0) == ode.model  # fmt: skip
    assert ours.data == ode.data and ours.trainer.id == f"{setting}_official"
    trainer = (ours.trainer.num_train_steps, ours.trainer.train_batch_size, ours.trainer.steps_per_eval)
    assert trainer == (steps, batch, every)
    opt = ours.optimizer
    assert (opt.learning_rate, opt.weight_decay, opt.beta1, opt.beta2, opt.epsilon) == (lr, 0.1, 0.9, 0.999, eps)
    assert (opt.max_grad_norm, opt.warmup, opt.min_lr_ratio, opt.lr_schedule) == (1.0, 0.01, 0.1, "cosine")
    _, flags, _ = paths_and_flags(model, with_decay_mask(opt, model))  # the mask the training loop builds
    assert {path for path, decays in flags.items() if decays} == {
        "token_embeddings.weight",
        "position_embeddings.weight",
    }


@pytest.mark.parametrize("setting", ["wikitext103_small", "owt_small"])
def test_small_ode_model_is_larger_than_its_baseline(setting: str) -> None:
    ode = describe(parse(PAPER / f"{setting}_ode.yaml", DescribeConfig))
    base = describe(parse(PAPER / f"{setting}_gpt2.yaml", DescribeConfig))
    assert ode["hypernetwork_params"] > 0 and base["hypernetwork_params"] == 0
    assert ode["total_params"] > base["total_params"]


def test_command_line_overrides_apply() -> None:
    args = ["--trainer.id", "run7", "--data.components.owt.source.validation_fraction", "0.001",
            "--trainer.mesh.axes", "{data: -1, replica: 1, model: 2}", "--model.max_seq_len", "512"]  # fmt: skip
    # draccus reads the dict data.components only whole: qkvflow.runs.configfile.overrides rewrites a key inside it
    config = parse(PAPER / "owt_small_ode.yaml", args=args)
    owt = config.data.components["owt"]
    assert config.trainer.id == "run7" and owt.source.validation_fraction == 0.001
    assert owt.source.id == "Skylion007/openwebtext"  # the rest of the component is kept
    assert os.path.basename(owt.cache_dir) == "owt"
    assert dict(config.trainer.mesh.axes) == {"data": -1, "replica": 1, "model": 2}
    assert config.trainer.mesh.param_mapping == {"embed": "data"} and config.model.max_seq_len == 512


def test_describe_command_reads_a_paper_config(capsys: pytest.CaptureFixture[str]) -> None:
    """`qkvflow describe` on a config with the jsonl + wandb trackers and the held-out data split."""
    path = str(PAPER / "owt_llama_1b_ode.yaml")
    assert describe_main(["--config_path", path, "--vocab_size", "32000"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["model_type"] == "DiffEqFormerLlamaConfig" and out["hypernetwork_params"] > 0
