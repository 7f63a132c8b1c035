"""`qkvflow export`: checkpoints of tiny ODE models exported and read back by `transformers` in torch.

Checkpoints are saved as training saves them ({"model": ...} under step-N), with seeded random
weights (no initialiser runs). Logits are compared on the same tokens: torch export vs the JAX
discrete model, and, at M = N Euler steps, vs the ODE model itself.
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Optional

import numpy as np
import pytest

from tests.helpers import logit_tolerance
from tests.timescale import limit

ROOT = Path(__file__).resolve().parents[2]
N = 4  # ode.num_steps of the tiny models
HIDDEN = 32  # their hidden_dim
MODEL_YAML = """
model:
  type: {type}
  max_seq_len: 12
  hidden_dim: 32
  num_heads: 4
  time_embed_dim: 8
  num_frequencies: 16
  ode:
    num_steps: 4
"""
GPT2_YAML = "model:\n  type: gpt2\n  max_seq_len: 12\n  hidden_dim: 32\n  num_heads: 4\n  num_layers: 2\n"
TOKENS = np.array([[5, 17, 300, 42, 9, 1000, 7, 7, 123, 64, 2, 88], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]])


def _relative_error(a, b) -> float:
    return float(np.abs(a - b).max() / np.abs(b).max())


def _save_run(workdir: Path, corpus_root: Path, model_yaml: str, *, seed=0):
    """(config path, checkpoint dir, model) of a random model of `model_yaml`, saved as training does."""
    import levanter.checkpoint
    from haliax import Axis

    import qkvflow.models.discrete  # noqa: F401
    from qkvflow.runs.config import TrainConfig
    from qkvflow.runs.corpus import with_corpus
    from tests.analysis.builders import filled
    from tests.helpers import parse_config

    workdir.mkdir(parents=True, exist_ok=True)
    config_path = workdir / "config.yaml"
    config_path.write_text(f"corpus:\n  name: pydoc\n  root: {corpus_root}\n{model_yaml}")
    config = parse_config(config_path, TrainConfig)
    vocab = Axis("vocab", len(with_corpus(config).data.the_tokenizer))
    model = filled(config.model, vocab, seed=seed, std=0.1)
    step = workdir / "checkpoints" / "step-0"
    levanter.checkpoint.save_checkpoint({"model": model}, step=0, checkpoint_path=str(step), is_temporary=False)
    return str(config_path), str(workdir / "checkpoints"), model


@pytest.fixture(scope="module")
def runs(tmp_path_factory, corpus_root):
    base = tmp_path_factory.mktemp("export_runs")
    return {
        kind: _save_run(base / kind, corpus_root, MODEL_YAML.format(type=kind))
        for kind in ("diffeqformer_gpt2", "diffeqformer_llama", "shared_ode_gpt2")
    }


def _export(capsys, config_path, checkpoint, output, *extra) -> dict:
    from qkvflow.cli import main

    rc = main(["export", "--config_path", config_path, "--checkpoint", checkpoint, "--output", str(output), *extra])
    out, err = capsys.readouterr()
    assert rc == 0, err
    return json.loads(out)


def _torch_logits(folder, **kwargs) -> np.ndarray:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), **kwargs).eval()
    with torch.no_grad():
        return model(torch.tensor(TOKENS)).logits.numpy()


def _jax_logits(model) -> np.ndarray:
    import haliax as hax
    from haliax import Axis

    ids = hax.named(TOKENS.astype(np.int32), (Axis("batch", 2), model.Pos))
    return np.asarray(model(ids).array)


@pytest.fixture(scope="module")
def exported(runs, tmp_path_factory):
    """kind -> (folder, summary) of `qkvflow export ... --ode` at the default M = N."""
    import contextlib
    import io

    from qkvflow.cli import main

    out = {}
    for kind, (config_path, checkpoint, _) in runs.items():
        folder = tmp_path_factory.mktemp("export") / kind
        stdout = io.StringIO()
        with contextlib.redirect_stdout(stdout):
            args = ["--config_path", config_path, "--checkpoint", checkpoint, "--output", str(folder), "--ode"]
            rc = main(["export", *args])
        assert rc == 0
        out[kind] = folder, json.loads(stdout.getvalue())
    return out


@pytest.mark.parametrize("kind", ["diffeqformer_gpt2", "diffeqformer_llama", "shared_ode_gpt2"])
def test_export_at_n_steps_gives_the_ode_models_logits_in_torch(runs, exported, kind):
    from qkvflow.models.discretise import discretise

    model = runs[kind][2]
    folder, summary = exported[kind]
    assert summary["layers"] == N and summary["equals_ode_solve"]
    torch_logits = _torch_logits(folder, trust_remote_code=True)
    tol = logit_tolerance(N, HIDDEN)
    assert _relative_error(torch_logits, _jax_logits(discretise(model, N))) < tol
    assert _relative_error(torch_logits, _jax_logits(model)) < tol
    config = json.loads((folder / "config.json").read_text())
    assert config["auto_map"]["AutoModelForCausalLM"].startswith("modeling_qkvflow.")
    assert config["num_hidden_layers"] == N and config["ode_steps"] == N


def test_other_depths_match_the_discrete_model_generate_and_overwrite(runs, tmp_path, capsys):
    import torch
    from transformers import AutoModelForCausalLM

    from qkvflow.models.discretise import discretise
    from qkvflow.outputs import MARKER

    config_path, checkpoint, model = runs["diffeqformer_llama"]
    out = tmp_path / "hf"
    assert _export(capsys, config_path, checkpoint, out, "--steps", "N/2")["layers"] == N // 2  # eval's forms
    first = json.loads((out / MARKER).read_text())
    assert first["kind"] == "hf_export" and "model.safetensors" in first["files"]
    summary = _export(capsys, config_path, checkpoint, out, "--steps", "6", "--overwrite")  # swaps the first out
    assert summary["layers"] == 6 and not summary["equals_ode_solve"]
    assert all(f.startswith(str(out) + "/") and os.path.isfile(f) for f in summary["files"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]  # no temporary or old folder left
    torch_logits = _torch_logits(out, trust_remote_code=True)
    assert _relative_error(torch_logits, _jax_logits(discretise(model, 6))) < logit_tolerance(6, HIDDEN)
    hf = AutoModelForCausalLM.from_pretrained(str(out), trust_remote_code=True).eval()
    prompt = torch.tensor(TOKENS[:, :4])
    generated = hf.generate(prompt, max_new_tokens=5, do_sample=False)
    assert generated.shape == (2, 9) and torch.equal(generated[:, :4], prompt)
    with torch.no_grad():  # greedy decoding without a cache = argmax of the full forward pass
        assert int(generated[0, 4]) == int(hf(prompt).logits[0, -1].argmax())


def _jax_greedy(model, prompt_ids: list[int], new_tokens: Optional[int] = None) -> list[int]:
    """Greedy decoding with the JAX ODE model, one full-sequence forward pass per new token: the argmax of
    the logits at the last real position. Causal attention: the zeros after the prompt change nothing."""
    import equinox as eqx
    import haliax as hax
    from haliax import Axis

    global _forward
    if _forward is None:  # one jitted function for the module, so each model compiles once
        _forward = eqx.filter_jit(lambda m, tokens: m(tokens).array)
    seq_len = model.Pos.size
    stop = seq_len if new_tokens is None else len(prompt_ids) + new_tokens
    ids = list(prompt_ids)
    while len(ids) < stop:
        padded = np.zeros((1, seq_len), np.int32)
        padded[0, : len(ids)] = ids
        logits = np.asarray(_forward(model, hax.named(padded, (Axis("batch", 1), model.Pos))))
        ids.append(int(np.argmax(logits[0, len(ids) - 1])))
    return ids[len(prompt_ids) :]


_forward = None


def _jax_logits_of(model, prompt_ids: list[int]) -> np.ndarray:
    """The JAX ODE model's logits at the positions of one unpadded prompt."""
    import equinox as eqx
    import haliax as hax
    from haliax import Axis

    global _forward
    if _forward is None:
        _forward = eqx.filter_jit(lambda m, tokens: m(tokens).array)
    padded = np.zeros((1, model.Pos.size), np.int32)
    padded[0, : len(prompt_ids)] = prompt_ids
    return np.asarray(_forward(model, hax.named(padded, (Axis("batch", 1), model.Pos))))[0, : len(prompt_ids)]


@pytest.mark.parametrize("kind", ["diffeqformer_gpt2", "diffeqformer_llama"])
def test_generate_a_left_padded_batch_token_for_token_as_jax(runs, exported, kind):
    """A batch of prompts of different lengths, left-padded as transformers pads for generation: each row
    continues exactly as the JAX model continues that prompt alone. Positions must count real tokens only
    (the pad is not position 0.., the first real token is; GPT-2's learned positions and Llama's rotary
    angles both depend on it) and padded keys must be masked out of attention."""
    import torch
    from transformers import AutoModelForCausalLM

    folder, model = exported[kind][0], runs[kind][2]
    hf = AutoModelForCausalLM.from_pretrained(str(folder), trust_remote_code=True).eval()
    eos = hf.generation_config.eos_token_id
    prompts = [[17, 300, 42, 9, 1000, 7], [123, 64], [5, 88, 2, 250]]  # lengths 6, 2, 4: padding 0, 4, 2
    longest, new = max(map(len, prompts)), model.Pos.size - max(map(len, prompts))  # fill the context: 6 new
    references = [_jax_greedy(model, p, new) for p in prompts]
    assert all(eos not in r for r in references)  # else generate would rightly stop that row early
    pad = eos
    ids = torch.tensor([[pad] * (longest - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        generated = hf.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=new, do_sample=False, pad_token_id=pad
        )
        logits = hf(input_ids=ids, attention_mask=mask).logits.numpy()
    assert generated[:, longest:].tolist() == references
    # and the logits at the real positions are each prompt's own, to float32 round-off (argmax alone can
    # hide a small leak of the padded keys into attention)
    for row, p in enumerate(prompts):
        alone = _jax_logits_of(model, p)
        assert _relative_error(logits[row, longest - len(p) :], alone) < logit_tolerance(N, HIDDEN), row


@pytest.mark.parametrize("kind", ["diffeqformer_gpt2", "diffeqformer_llama"])
def test_generate_from_a_prompt_continues_as_jax_greedy_decoding(runs, exported, corpus_root, kind):
    """`model.generate(**tokenizer(prompt))` as a transformers user writes it: the prompt is encoded as a
    training document starts (EOS, then the text, no end marker) and the new tokens are the ODE model's."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, model = exported[kind][0], runs[kind][2]
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    corpus_tokenizer = AutoTokenizer.from_pretrained(str(corpus_root / "pydoc" / "tokenizer"))
    prompt = "The return statement"
    eos = corpus_tokenizer.eos_token_id
    prompt_ids = [eos] + corpus_tokenizer(prompt, add_special_tokens=False)["input_ids"]
    inputs = tokenizer(prompt, return_tensors="pt")
    assert inputs["input_ids"][0].tolist() == prompt_ids

    reference = _jax_greedy(model, prompt_ids)
    assert len(reference) >= 5 and eos not in reference  # else generate would rightly stop early

    hf = AutoModelForCausalLM.from_pretrained(str(folder), trust_remote_code=True).eval()
    with torch.no_grad():
        generated = hf.generate(**inputs, max_new_tokens=len(reference), do_sample=False)
    assert generated[0, len(prompt_ids) :].tolist() == reference


def test_qkvflow_generate_and_transformers_generate_agree_on_the_same_prompt_text(runs, exported, tmp_path, capsys):
    """Issue 31: `qkvflow generate` on the run and transformers' `generate` on its export, both from the same
    prompt text: the same prompt ids (framed as training framed a document's start, by Levanter's own
    document tokenizer, without its end marker) and the same greedy tokens."""
    import torch
    from levanter.data.text._batch_tokenizer import BatchTokenizer
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from qkvflow.cli import main

    config_path, checkpoint, _ = runs["diffeqformer_gpt2"]
    folder = exported["diffeqformer_gpt2"][0]
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    prompt = "A list is"
    inputs = tokenizer(prompt, return_tensors="pt")
    framed = BatchTokenizer(tokenizer, enforce_eos=False)([{"text": prompt}])[0]["input_ids"]
    assert inputs["input_ids"][0].tolist() == framed and framed[0] == tokenizer.bos_token_id
    new = 12 - len(framed)  # fill the context (max_seq_len 12)
    out = tmp_path / "out.jsonl"
    argv = ["generate", "--config_path", config_path, "--checkpoint", checkpoint, "--prompt", prompt,
            "--max_new_tokens", str(new), "--output_jsonl", str(out)]  # fmt: skip
    assert main(argv) == 0, capsys.readouterr().err
    ours = json.loads(out.read_text())["tokens"]
    hf = AutoModelForCausalLM.from_pretrained(str(folder), trust_remote_code=True).eval()
    eos = hf.generation_config.eos_token_id
    with torch.no_grad():
        generated = hf.generate(**inputs, max_new_tokens=new, do_sample=False)[0, len(framed) :].tolist()
    assert eos not in generated and len(ours) == new  # else one would rightly stop early
    assert ours == generated


def test_register_loads_without_remote_code_and_the_tokenizer_is_there(runs, exported):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import qkvflow.export.hf

    folder, _ = exported["diffeqformer_gpt2"]
    qkvflow.export.hf.register()
    hf = AutoModelForCausalLM.from_pretrained(str(folder), trust_remote_code=False)
    assert type(hf).__module__ == "qkvflow.export.hf.modeling_qkvflow"
    assert len(AutoTokenizer.from_pretrained(str(folder))) == runs["diffeqformer_gpt2"][2].Vocab.size


@pytest.mark.slow  # a fresh interpreter importing torch and transformers: ~15 s
def test_exported_folder_loads_with_qkvflow_unimportable(exported, tmp_path):
    folder, _ = exported["diffeqformer_llama"]
    code = (
        "import sys; sys.modules['qkvflow'] = None\n"
        "from transformers import AutoModelForCausalLM\n"
        f"m = AutoModelForCausalLM.from_pretrained({str(folder)!r}, trust_remote_code=True)\n"
        "print(type(m).__name__)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=limit(300)
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "QkvflowParallelLlamaForCausalLM" in proc.stdout


def test_ode_export_round_trip(runs, exported):
    import jax

    from qkvflow.export.ode import load_ode_export

    for kind in ("diffeqformer_llama", "shared_ode_gpt2"):
        model = runs[kind][2]
        loaded = load_ode_export(str(exported[kind][0] / "ode"))
        assert type(loaded.config) is type(model.config) and loaded.config == model.config
        for a, b in zip(jax.tree_util.tree_leaves(loaded), jax.tree_util.tree_leaves(model), strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    np.testing.assert_array_equal(_jax_logits(loaded), _jax_logits(model))  # shared_ode_gpt2


def _refused(capsys, args) -> str:
    from qkvflow.cli import main

    rc = main(["export", *args])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert err.count("\n") == 1 and err.startswith("qkvflow export: error: ") and "Traceback" not in err
    return err


def test_bad_input_is_refused_with_one_line(runs, tmp_path, capsys, corpus_root):
    config_path, checkpoint, _ = runs["diffeqformer_gpt2"]
    args = ["--config_path", config_path, "--checkpoint", checkpoint]
    err = _refused(capsys, [*args, "--steps", "0", "--output", str(tmp_path / "a")])
    assert "--steps 0 is invalid: expected an integer >= 1" in err
    for steps in ("2.5N", "N,2N"):  # export writes one depth M (issue 56, item 20: eval's forms, one of them)
        err = _refused(capsys, [*args, "--steps", steps, "--output", str(tmp_path / "a")])
        assert f"--steps {steps!r} is invalid: expected one number of layers M: an integer >= 1 or a multiple" in err
    err = _refused(capsys, [*args, "--steps", "auto", "--output", str(tmp_path / "a")])
    assert "--steps auto is not taken: export writes one depth M; choose it with `qkvflow eval --steps auto`" in err
    assert "--solver rk4 is invalid: expected one of ['euler']" in _refused(
        capsys, [*args, "--solver", "rk4", "--output", str(tmp_path / "a")]
    )
    full = tmp_path / "full"
    full.mkdir()
    (full / "keep.txt").write_text("mine")
    assert "is not empty and was not written by qkvflow" in _refused(capsys, [*args, "--output", str(full)])
    assert (full / "keep.txt").read_text() == "mine"

    gpt2_config, gpt2_checkpoint, _ = _save_run(tmp_path / "gpt2", corpus_root, GPT2_YAML)
    gpt2_args = ["--config_path", gpt2_config, "--checkpoint", gpt2_checkpoint]
    err = _refused(capsys, [*gpt2_args, "--output", str(tmp_path / "b")])
    assert "export needs a DiffEqFormer checkpoint; got model.type=gpt2" in err
    parallel = tmp_path / "parallel.yaml"
    parallel.write_text(f"corpus:\n  name: pydoc\n  root: {corpus_root}\nmodel:\n  type: parallel_gpt2\n")
    err = _refused(
        capsys, ["--config_path", str(parallel), "--checkpoint", checkpoint, "--output", str(tmp_path / "d")]
    )
    assert "got model.type=parallel_gpt2" in err
    err = _refused(capsys, [*args[:2], "--checkpoint", gpt2_checkpoint, "--output", str(tmp_path / "c")])
    assert "does not hold a DiffEqFormerGpt2Config model" in err
    assert not any((tmp_path / name).exists() for name in "abcd")


def test_a_step_with_garbage_metadata_is_refused_by_every_loading_verb_as_train_refuses_it(runs, tmp_path, capsys):
    """Issue 31: a run folder whose newest step has a garbage metadata.json. `train` refuses it (exit 2, one
    line: qkvflow.training.faults); export, eval and generate refuse it with the same line instead of
    passing over it to the older step. With the step moved aside, the verb says which step it loaded."""
    import shutil

    from qkvflow.cli import main
    from qkvflow.errors import UserError
    from qkvflow.training import faults

    config_path, checkpoint, _ = runs["diffeqformer_gpt2"]
    run = tmp_path / "run"
    shutil.copytree(checkpoint, run)
    (run / "step-1").mkdir()
    (run / "step-1" / "metadata.json").write_text("{garbage")
    with pytest.raises(UserError) as train_refusal:
        faults.incomplete_checkpoints(str(run))  # what `qkvflow train` runs on its run folder before anything
    expected = str(train_refusal.value)
    assert "step-1: its metadata.json is not valid JSON" in expected
    common = ["--config_path", config_path, "--checkpoint", str(run)]
    for verb, extra in [
        ("export", ["--output", str(tmp_path / "out")]),
        ("eval", []),
        ("generate", ["--prompt", "A", "--max_new_tokens", "4"]),
    ]:
        assert main([verb, *common, *extra]) == 2, verb
        err = capsys.readouterr().err
        assert err == f"qkvflow {verb}: error: {expected}\n", (verb, err)
    assert not (tmp_path / "out").exists()
    shutil.move(run / "step-1", tmp_path / "aside")
    assert main(["export", *common, "--output", str(tmp_path / "out")]) == 0
    assert capsys.readouterr().err == f"loaded checkpoint {run / 'step-0'}\n"


def _ocdbt_layout(step: Path) -> dict[str, list[tuple[int, int, str]]]:
    """What each data file d/<name> of the checkpoint's OCDBT database holds for its newest version, read
    with tensorstore's own `ocdbt.dump`: (start, end, what) byte ranges, `what` the array a chunk or
    metadata value belongs to (`model.a.b` for key model/a/b/c/0 or model/a/b/zarr.json) or "index" for the
    b-tree node that the newest version's reads go through (values inline in that node are in no file)."""
    import tensorstore as ts

    base = ts.KvStore.open({"driver": "file", "path": f"{step}/"}).result()
    newest = ts.ocdbt.dump(base).result()["versions"][-1]
    assert newest["root_height"] == 0, "the tiny checkpoint's index is one b-tree node"
    layout: dict[str, list[tuple[int, int, str]]] = {}

    def add(location: str, what: str) -> None:
        name, offset, length = location.split("::d/")[1].rsplit(":", 2)
        layout.setdefault(name, []).append((int(offset), int(offset) + int(length), what))

    root = newest["root"]["location"]
    add(root, "index")
    for entry in ts.ocdbt.dump(base, root).result()["entries"]:
        if "indirect_value" in entry:
            key = entry["key"].decode()
            add(entry["indirect_value"], re.split(r"/c/|/c$|/zarr\.json$", key)[0].replace("/", "."))
    return layout


def test_a_damaged_checkpoint_is_named_in_one_line(runs, tmp_path, capsys):
    """marin-levanter writes a checkpoint as one OCDBT database (step-N/manifest.ocdbt, step-N/d/*), so a
    damaged file may hold a chunk of any array or a node of the database's index: each is one line naming
    the checkpoint and an array whose bytes were cut (or the database file when its index node was).
    Which values the writer packed into which file depends on its timing, so what each cut damages is
    read from the database's own layout (`_ocdbt_layout`): every data file cut in half, then each file
    cut inside its last value where that is an array's (only that array damaged: it must be the one named;
    a file whose last value is the index node has no such cut)."""
    import shutil

    from qkvflow.cli import main

    config_path, checkpoint, _ = runs["diffeqformer_gpt2"]
    step = Path(checkpoint) / "step-0"
    assert not list(Path(checkpoint).rglob(".zarray")) and (step / "manifest.ocdbt").exists()
    layout = _ocdbt_layout(step)
    assert set(layout) <= {p.name for p in (step / "d").iterdir()}
    cuts = [(name, (step / "d" / name).stat().st_size // 2) for name in sorted(layout)]
    alone = [(name, max(items)) for name, items in sorted(layout.items()) if max(items)[2] != "index"]
    cuts += [(name, (start + end) // 2) for name, (start, end, _) in alone]
    # `alone` may be empty: with the stacked hypernetworks the writer often packs every value and the index
    # node into one file, whose last value is then the index; the halves above still cut arrays and index.
    assert any(what != "index" for items in layout.values() for *_, what in items), layout
    named = []
    for i, (name, size) in enumerate(cuts):
        damaged = {what for start, end, what in layout[name] if end > size}
        copy = tmp_path / f"run{i}"
        shutil.copytree(checkpoint, copy)  # a new path: nothing read before is cached
        os.truncate(copy / "step-0" / "d" / name, size)
        rc = main(
            ["export", "--config_path", config_path, "--checkpoint", str(copy), "--output", str(tmp_path / f"o{i}")]
        )
        err = capsys.readouterr().err
        if not damaged:  # only values of older versions cut: nothing the export reads
            assert rc == 0, err
            named.append(None)
            continue
        assert rc == 2 and err.count("\n") == 1 and "Traceback" not in err, err
        assert err.startswith(f"qkvflow export: error: checkpoint '{copy / 'step-0'}': ") and len(err) < 400, err
        assert "is damaged (Requested byte range" in err and err.endswith("; use an earlier step-N folder of the run\n")
        array = re.search(r": array (model\.[\w.+]+) cannot be read, its (chunk '[\d/]+'|metadata \(zarr.json\))", err)
        index = f": its OCDBT database file 'd/{name}' is damaged (" in err
        assert (array.group(1) if array else "index" if index else None) in damaged, (err, damaged)
        named.append(array.group(1) if array else "index")
    assert named[len(named) - len(alone) :] == [what for _, (_, _, what) in alone]  # each array cut alone, by its name


def _snapshot(folder: Path) -> dict:
    return {str(p): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_overwrite_never_replaces_what_export_did_not_write(runs, tmp_path, capsys, monkeypatch):
    """--output ., an ancestor of the current folder, the folder holding the checkpoint or the config,
    and a folder of the user's: exit 2, one line, every file still there (before any model is loaded)."""
    import qkvflow.runs.checkpoints

    config_path, checkpoint, _ = runs["diffeqformer_gpt2"]
    work = tmp_path / "work"
    (work / "here").mkdir(parents=True)
    (work / "here" / "notes.txt").write_text("mine")
    (work / "configs").mkdir()
    own_config = work / "configs" / "run.yaml"
    own_config.write_text(Path(config_path).read_text())
    (work / "theirs").mkdir()
    (work / "theirs" / "thesis.tex").write_text("years of work")
    monkeypatch.chdir(work / "here")
    monkeypatch.setattr(qkvflow.runs.model, "load_model", lambda *a, **k: pytest.fail("loaded the model"))
    run_folder = Path(checkpoint).parent  # holds config.yaml and checkpoints/
    before = _snapshot(tmp_path), _snapshot(run_folder)
    cases = [
        (".", config_path, "is or holds the current folder"),
        (str(work), config_path, "is or holds the current folder"),
        (str(run_folder), config_path, f"is or holds --checkpoint {checkpoint!r}"),
        (checkpoint, config_path, f"is or holds --checkpoint {checkpoint!r}"),
        (f"{checkpoint}/step-0/exp", config_path, f"is inside the run folder of --checkpoint {checkpoint!r}"),
        (f"{checkpoint}/exp", config_path, f"is inside the run folder of --checkpoint {checkpoint!r}"),
        (str(work / "configs"), str(own_config), f"is or holds --config_path {str(own_config)!r}"),
        (str(work / "theirs"), config_path, "is not empty and was not written by qkvflow"),
    ]
    for output, config, reason in cases:
        err = _refused(capsys, ["--config_path", config, "--checkpoint", checkpoint, "--output", output, "--overwrite"])
        assert f"--output={output!r}" in err and reason in err, err
    step = f"{checkpoint}/step-0"  # a step folder as --checkpoint: its run folder is kept apart all the same
    err = _refused(capsys, ["--config_path", config_path, "--checkpoint", step, "--output", f"{checkpoint}/exp"])
    assert f"is inside the run folder of --checkpoint {checkpoint!r}" in err, err
    assert (_snapshot(tmp_path), _snapshot(run_folder)) == before
    assert sorted(p.name for p in work.iterdir()) == ["configs", "here", "theirs"]


def test_a_failing_export_leaves_the_earlier_one_intact(runs, tmp_path, capsys, monkeypatch):
    import qkvflow.export.hf_folder

    config_path, checkpoint, _ = runs["diffeqformer_gpt2"]
    out = tmp_path / "hf"
    _export(capsys, config_path, checkpoint, out, "--steps", "2")
    before = _snapshot(out)
    real = qkvflow.export.hf_folder.save_hf_folder

    def dies_midway(model, folder, **kwargs):
        real(model, folder, **kwargs)
        Path(folder, "model.safetensors").write_bytes(b"half written")
        raise OSError("disk full")

    monkeypatch.setattr(qkvflow.export.hf_folder, "save_hf_folder", dies_midway)
    from qkvflow.cli import main

    with pytest.raises(OSError, match="disk full"):
        main(["export", "--config_path", config_path, "--checkpoint", checkpoint, "--output", str(out), "--overwrite"])
    assert _snapshot(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]
