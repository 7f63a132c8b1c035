"""The study file of `qkvflow bench compare`: read and checked, and each of its runs' `qkvflow train` config.

A study (benchmarks/compare/*.yaml) names a base config, a budget, learning rates, seeds, a baseline and
its models, each an overlay merged into the base (`merge`). `load_study` reads it with the command
line's overrides and refuses a bad key or value in one line; `check_base` checks the base config's data
(a bundled corpus, or a `data:` section whose halves can be made: qkvflow.bench.comparison.halves).
`run_config` is the full config of one run (`run_id`: model, learning rate, seed), evaluating on the
selection or test half; `identity` is what may not change between invocations on one work folder;
`check_attention` keeps one attention kernel for every run.
"""

import copy
from pathlib import Path

import yaml

from qkvflow.bench.comparison import depth_curves, halves, matching
from qkvflow.data.corpora import NAMES
from qkvflow.errors import UserError
from qkvflow.models import registry
from qkvflow.nn.attention import CHOICES

STUDY_KEYS = {"base", "baseline", "iters", "learning_rates", "seeds", "models", "title", "depth"}
STUDY_ONLY = ("learning_rates", "match")
"""Keys of a model's entry that are the study's business, not its run's (its grid, what it is matched to)."""


def load_study(path: str, args) -> dict:
    """The study file with the command line's overrides, checked; `base` resolved beside the file."""
    try:
        study = yaml.safe_load(Path(path).read_text())
    except OSError as e:
        raise UserError(f"bench compare: cannot read study {path}: {e.strerror}") from None
    if not isinstance(study, dict):
        raise UserError(f"bench compare: {path}: expected a mapping with keys {sorted(STUDY_KEYS)}")
    unknown = set(study) - STUDY_KEYS
    if unknown:
        raise UserError(f"bench compare: {path}: unknown key(s) {sorted(unknown)}; expected {sorted(STUDY_KEYS)}")
    for key, given in (("iters", args.iters), ("seeds", args.seeds), ("learning_rates", args.learning_rates)):
        if given is not None:
            study[key] = (
                given if key == "iters" else [float(x) if key == "learning_rates" else int(x) for x in given.split(",")]
            )
    models = study.get("models")
    if not isinstance(models, dict) or not models or not all(isinstance(o, dict) for o in models.values()):
        raise UserError(f"bench compare: {path}: models: expected a mapping of name -> overlay")
    for name, overlay in models.items():
        if args.learning_rates is not None:  # the command line's grid is every model's
            models[name] = {k: v for k, v in overlay.items() if k != "learning_rates"}
        elif "learning_rates" in overlay and not _valid_rates(overlay["learning_rates"]):
            raise UserError(
                f"bench compare: {path}: models.{name}.learning_rates={overlay['learning_rates']!r} is invalid: "
                "expected numbers in (0, 1)"
            )
        if "match" in overlay:
            matching.check(path, name, overlay["match"], models)
    if args.baseline is not None:
        study["baseline"] = args.baseline
    if study.get("baseline") not in models:
        raise UserError(
            f"bench compare: {path}: baseline={study.get('baseline')!r} is not one of the models {sorted(models)}"
        )
    study["defined"] = models  # every model of the file (a matched model's target may be left out of --models)
    if args.models:
        chosen = [m.strip() for m in args.models.split(",") if m.strip()]
        missing = [m for m in chosen if m not in models]
        if missing:
            raise UserError(f"--models: {missing} not in the study's models {sorted(models)}")
        study["joined"] = study["baseline"] not in chosen  # the baseline joins a subset that leaves it out
        chosen = [study["baseline"]] * study["joined"] + chosen
        study["models"] = {m: models[m] for m in dict.fromkeys(chosen)}
    if not isinstance(study.get("iters"), int) or study["iters"] < 1:
        raise UserError(f"bench compare: {path}: iters={study.get('iters')!r} is invalid: expected an integer >= 1")
    lrs, seeds = study.get("learning_rates"), study.get("seeds")
    if not _valid_rates(lrs):
        raise UserError(f"bench compare: {path}: learning_rates={lrs!r} is invalid: expected numbers in (0, 1)")
    if not seeds or not all(isinstance(s, int) and s >= 0 for s in seeds) or len(set(seeds)) != len(seeds):
        raise UserError(f"bench compare: {path}: seeds={seeds!r} is invalid: expected distinct integers >= 0")
    base = (Path(path).parent / str(study.get("base"))).resolve()
    if not base.is_file():
        raise UserError(f"bench compare: {path}: base={study.get('base')!r}: no such file beside the study")
    study["base"] = str(base)
    study["name"], study["file"] = Path(path).stem, path
    if "depth" in study:  # every chosen ODE run also evaluated at these grids (qkvflow.bench.comparison.depth_curves)
        study["depth"] = depth_curves.check(study["depth"], path)
    study["base_config"] = check_base(str(base))
    return study


def check_base(path: str) -> dict:
    """The base config, checked: a bundled `corpus:` with a known name, or a `data:` section whose
    selection/test halves can be made (qkvflow.bench.comparison.halves; its local paths made absolute)."""
    try:
        config = yaml.safe_load(Path(path).read_text())
    except yaml.YAMLError as e:
        raise UserError(f"bench compare: base {path} is not valid YAML: {e}".replace("\n", " ")) from None
    if not isinstance(config, dict):
        raise UserError(f"bench compare: base {path}: expected a `qkvflow train` config (a mapping)")
    corpus = config.get("corpus")
    if corpus is None:
        return halves.check(path, config)
    if not isinstance(corpus, dict) or corpus.get("name") not in NAMES:
        raise UserError(f"bench compare: base {path}: corpus.name: expected one of {', '.join(NAMES)}")
    return config


def _valid_rates(lrs) -> bool:
    return isinstance(lrs, list) and bool(lrs) and all(isinstance(x, (int, float)) and 0 < x < 1 for x in lrs)


def model_entry(study: dict, model: str) -> dict:
    """`model`'s entry in the study file (also a model left out of --models: a matched model's target)."""
    return study["models"][model] if model in study["models"] else study["defined"][model]


def learning_rates(study: dict, model: str) -> list:
    """`model`'s learning-rate grid: its own `learning_rates`, else the study's."""
    return model_entry(study, model).get("learning_rates", study["learning_rates"])


def model_overlay(study: dict, model: str) -> dict:
    """`model`'s overlay of the base config (without what is the study's business: `STUDY_ONLY`)."""
    return {k: v for k, v in model_entry(study, model).items() if k not in STUDY_ONLY}


def merge(base: dict, overlay: dict) -> dict:
    """`base` with `overlay` merged in, mappings key by key (a `model:` overlay replaces the base's model)."""
    out = copy.deepcopy(base)
    for key, value in overlay.items():
        if key != "model" and isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def run_id(model: str, lr: float, seed: int) -> str:
    return f"{model}-lr{lr:g}-s{seed}"


def run_config(
    study: dict, model: str, lr: float, seed: int, workdir: Path, corpus_root: str, half: str = "selection"
) -> dict:
    """The full `qkvflow train` config of one run, evaluating on `half` (selection or test)."""
    config = merge(study["base_config"], model_overlay(study, model))
    if "corpus" in config:
        config["corpus"] = {**config["corpus"], "root": corpus_root, "eval_split": half}
    else:
        config = halves.point_at(config, workdir, half)
    config["data_seed"] = seed
    config["loss_curve"] = None
    t = config.setdefault("trainer", {})
    t.update(id=run_id(model, lr, seed), seed=seed, num_train_steps=study["iters"], steps_per_eval=study["iters"])
    t["checkpointer"] = {**t.get("checkpointer", {}), "base_path": str(workdir / "checkpoints")}
    t["tracker"] = {"type": "jsonl", "path": str(workdir / "runs")}
    t["log_dir"] = str(workdir / "logs")
    config.setdefault("optimizer", {})["learning_rate"] = lr
    return config


def identity(study: dict) -> dict:
    """What must not change between invocations on one work folder: the base config, the budget, and
    each model's definition (seeds, learning rates and further models may be added)."""
    models = {m: model_overlay(study, m) for m in study["models"]}
    return {"base": Path(study["base"]).read_text(), "models": models, "iters": study["iters"]}


def check_attention(study: dict, args) -> None:
    """One kernel for every run: --attention is known, and no model's config names a backend of its own."""
    if args.attention not in CHOICES:
        raise UserError(f"--attention={args.attention} is invalid: expected one of {', '.join(CHOICES)}")
    base = yaml.safe_load(Path(study["base"]).read_text())
    for model in study["models"]:
        own = (merge(base, model_overlay(study, model)).get("model") or {}).get("attn_backend")
        if own not in (None, "default"):
            raise UserError(
                f"bench compare: model {model} sets model.attn_backend={own}: every run takes --attention "
                f"({args.attention}), so that no model gets a kernel of its own; drop the key"
            )


def is_ode(study: dict, model: str) -> bool:
    kind = (model_overlay(study, model).get("model") or {}).get("type")
    return kind in {f.name for f in registry.families() if f.ode}
