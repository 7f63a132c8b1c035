"""Levanter 1.2 config keys are refused in one line that names the key, where it was and what replaces it;
every shipped YAML and keys of the same name elsewhere pass."""

from pathlib import Path

import pytest
import yaml

from qkvflow.errors import UserError
from qkvflow.runs.compat import OLD_KEYS, check_config, check_old_keys, check_old_overrides

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = sorted(p for d in ("configs", "tests/configs", "benchmarks/configs") for p in (ROOT / d).rglob("*.yaml"))

# old dotted key, an old value, a word its replacement must name
CASES = [
    ("trainer.fsdp_axis", "embed", "trainer.mesh.param_mapping"),
    ("trainer.tensor_parallel_axes", ["mlp", "heads"], "trainer.mesh.shared_mapping"),
    ("trainer.batch_axis", "batch", "trainer.mesh.batch_axis_name"),
    ("trainer.model_axis_size", 2, "trainer.mesh.axes.model"),
    ("trainer.replica_ici_axis_size", 2, "trainer.mesh.axes.replica"),
    ("trainer.replica_dcn_axis_size", 2, "trainer.mesh.dcn_axes"),
    ("trainer.axis_resources", {"batch": "data"}, "trainer.mesh.compute_mapping"),
    ("trainer.parameter_axis_resources", {"embed": "data"}, "trainer.mesh.param_mapping"),
    ("trainer.ray", {"auto_start_cluster": False}, "delete"),
    ("trainer.profiler_num_steps", 10, "trainer.profiler.num_steps"),
    ("model.seq_len", 1024, "model.max_seq_len"),
    ("data.train_urls", ["a.jsonl"], "data.components.<name>.source.train_urls"),
    ("data.validation_urls", ["b.jsonl"], "data.components.<name>.source.validation_urls"),
    ("data.id", "Skylion007/openwebtext", "data.components.<name>.source.id"),
    ("data.name", "wikitext-103-raw-v1", "data.components.<name>.source.name"),
    ("data.configs", {"a": {"id": "x"}}, "data.components"),
    ("data.validation_fraction", 0.0005, "data.components.<name>.source.validation_fraction"),
]


def nest(dotted: str, value) -> dict:
    tree = value
    for part in reversed(dotted.split(".")):
        tree = {part: tree}
    return tree


def test_the_table_is_tested() -> None:
    assert {key for key, _, _ in CASES} <= set(OLD_KEYS)
    assert len(CASES) >= 17


@pytest.mark.parametrize("key, value, replacement", CASES, ids=[c[0] for c in CASES])
def test_each_old_key_in_a_file_is_one_line_naming_it_and_its_replacement(key, value, replacement) -> None:
    tree = {"trainer": {"num_train_steps": 10}, "model": {"hidden_dim": 8}}
    section, _, rest = key.partition(".")
    tree.setdefault(section, {}).update(nest(rest, value))
    with pytest.raises(UserError) as info:
        check_old_keys(tree, "configs/x.yaml")
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(f"configs/x.yaml: {key} was removed in marin-levanter; ")
    assert replacement in message


@pytest.mark.parametrize("key, value, replacement", CASES, ids=[c[0] for c in CASES])
def test_each_old_key_on_the_command_line_is_one_line(key, value, replacement) -> None:
    with pytest.raises(UserError) as info:
        check_old_overrides(["--trainer.id", "r1", f"--{key}", yaml.safe_dump(value).strip()])
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(f"command line: {key} was removed in marin-levanter; ") and replacement in message


def test_the_exact_message_for_fsdp_axis() -> None:
    with pytest.raises(UserError) as info:
        check_old_keys({"trainer": {"fsdp_axis": "embed"}}, "configs/x.yaml")
    assert str(info.value) == (
        "configs/x.yaml: trainer.fsdp_axis was removed in marin-levanter; "
        "use trainer.mesh.param_mapping (e.g. {embed: data})"
    )


def test_overrides_of_keys_inside_an_old_section_and_with_equals() -> None:
    with pytest.raises(UserError, match=r"^command line: trainer\.ray\.auto_start_cluster was removed"):
        check_old_overrides(["--trainer.ray.auto_start_cluster", "false"])
    with pytest.raises(UserError, match=r"^command line: model\.seq_len was removed.*model\.max_seq_len"):
        check_old_overrides(["--model.seq_len=256"])


def test_a_boolean_profiler_is_the_old_shape() -> None:
    with pytest.raises(UserError, match=r"trainer\.profiler was removed.*trainer\.profiler\.enabled"):
        check_old_keys({"trainer": {"profiler": True}}, "c.yaml")
    with pytest.raises(UserError, match=r"trainer\.profiler.*profiler\.enabled"):
        check_old_overrides(["--trainer.profiler", "true"])
    check_old_keys({"trainer": {"profiler": {"enabled": True, "num_steps": 5}}}, "c.yaml")
    check_old_overrides(["--trainer.profiler.enabled", "true"])


def test_several_old_keys_are_still_one_line_and_all_named() -> None:
    tree = {"trainer": {"fsdp_axis": "embed", "ray": {}}, "model": {"seq_len": 8}}
    with pytest.raises(UserError) as info:
        check_old_keys(tree, "c.yaml")
    message = str(info.value)
    assert "\n" not in message and "trainer.fsdp_axis" in message
    assert "also old: trainer.ray, model.seq_len" in message


def test_a_fine_tune_configs_overrides_of_its_pretrained_config_are_checked() -> None:
    tree = {"pretrained": {"config_path": "p.yaml", "overrides": ["--model.seq_len", "512"]}}
    with pytest.raises(UserError) as info:
        check_old_keys(tree, "configs/finetune/f.yaml")
    assert str(info.value).startswith("configs/finetune/f.yaml: pretrained.overrides: model.seq_len was removed")
    check_old_keys({"pretrained": {"overrides": ["--model.max_seq_len", "512"]}}, "f.yaml")


@pytest.mark.parametrize(
    "tree",
    [
        {"bench": {"seq_len": 64, "batch": 8}},  # a section of qkvflow's own
        {"model": {"max_seq_len": 64, "ode": {"seq_len": 3}}},  # deeper than model.seq_len
        {"trainer": {"mesh": {"axes": {"model": 2}, "param_mapping": {"embed": "data"}}}},
        {"data": {"components": {"owt": {"source": {"type": "hf", "id": "x", "name": "y"}}}}},
        {"data": {"components": {"c": {"source": {"train_urls": ["a"], "validation_urls": ["b"]}}}}},
        {"sweep": {"ray": 1, "fsdp_axis": 2}, "corpus": {"name": "pydoc"}},
        {"seq_len": 3, "id": "top", "train_urls": []},  # top level, not under model/data
        {"model": "not a mapping", "data": None, "trainer": []},
        None,
        [],
    ],
)
def test_new_and_unrelated_keys_pass(tree) -> None:
    check_old_keys(tree, "c.yaml")


def test_unrelated_overrides_pass() -> None:
    check_old_overrides(
        [
            "--trainer.id",
            "r",
            "--bench.seq_len",
            "64",
            "--model.max_seq_len",
            "128",
            "--data.components.owt.cache_dir",
            "x",
        ]
    )
    check_old_overrides(["--trainer.mesh.axes", "{data: -1, replica: 1, model: 2}", "--trainer.ray_id", "3"])


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_shipped_yaml_passes(path: Path) -> None:
    check_config(str(path), [])


def test_check_config_names_the_file_and_leaves_unreadable_files_to_draccus(tmp_path: Path) -> None:
    old = tmp_path / "old.yaml"
    old.write_text("trainer:\n  tensor_parallel_axes: [mlp, heads]\n")
    with pytest.raises(UserError, match=rf"^{old}: trainer\.tensor_parallel_axes was removed"):
        check_config(str(old), [])
    with pytest.raises(UserError, match=r"^command line: data\.id was removed"):
        check_config(None, ["--data.id", "x"])
    bad = tmp_path / "bad.yaml"
    bad.write_text("trainer: [\n")
    check_config(str(bad), [])
    check_config(str(tmp_path / "missing.yaml"), [])
