"""What `qkvflow generate` runs (the command and its options are in qkvflow.cli.generate): prompts read
and checked, the decoding grid chosen, the run's model loaded (`qkvflow.runs.model`), the
completions decoded on Levanter's engine (`qkvflow.inference.generate`) and written.

    run(config)                      the completions of `config`'s prompts (and --output_jsonl written)
    read_prompts(config)             --prompt or --prompts_file, checked
    sampling_options(config)         the options as `SamplingOptions`, checked
    decoding_steps(config)           --steps as decoding takes it (None, N' or "auto"), checked before loading
    choose_steps(config, model, ..)  --steps auto: the grid `qkvflow eval --steps auto` would choose
"""

import dataclasses
import json
import os
import sys

from qkvflow import outputs
from qkvflow.errors import UserError
from qkvflow.evaluation import auto_steps, depth, evaluate
from qkvflow.evaluation.grids import ONE_GRID, parse_steps
from qkvflow.inference import generate as decoding
from qkvflow.inference.schedule import schedule
from qkvflow.models import registry
from qkvflow.runs import data_checks
from qkvflow.runs.corpus import with_corpus
from qkvflow.runs.finetune_config import FinetuneConfig
from qkvflow.runs.model import load_run_model, run_folder


def _unescape(text: str) -> str:
    return text.replace("\\n", "\n").replace("\\t", "\t")


def sampling_options(config):
    options = decoding.SamplingOptions(
        max_new_tokens=config.max_new_tokens,
        temperature=config.temperature,
        top_p=config.top_p,
        top_k=config.top_k,
        stop=(_unescape(config.stop),) if config.stop is not None else (),
        stop_token_ids=tuple(config.stop_token_ids),
        seed=config.seed,
    )
    options.check()
    return options


def read_prompts(config) -> list[str]:
    if (config.prompt is None) == (config.prompts_file is None):
        raise UserError("give one of --prompt TEXT or --prompts_file F (one prompt per line)")
    if config.prompt is not None:
        if not config.prompt.strip():
            raise UserError("--prompt is empty: expected text to continue")
        return [config.prompt]
    if not os.path.isfile(config.prompts_file):
        raise UserError(
            f"--prompts_file {config.prompts_file!r} does not exist: expected a text file, one prompt per line"
        )
    with open(config.prompts_file, encoding="utf-8") as f:
        prompts = [line.rstrip("\n") for line in f if line.strip()]
    if not prompts:
        raise UserError(f"--prompts_file {config.prompts_file!r} has no prompts: expected one prompt per line")
    return prompts


def decoding_steps(config):
    """--steps as decoding takes it: None (the trained grid), N' (an int), or "auto"; bad values, an
    adaptive solver and a model of fixed depth are refused before any model is loaded."""
    if isinstance(config, FinetuneConfig):
        return None  # a fine-tuning config's own `steps` is its depth M, not a grid N' (refuse_grids)
    model, auto = config.model, auto_steps.is_auto(config)
    auto_steps.check_auto(config)
    if config.steps is not None and not registry.is_ode(model):
        raise UserError(
            f"--steps {config.steps}: model.type={registry.type_name(model)} has a fixed depth; "
            "a decoding grid applies to DiffEqFormer checkpoints"
        )
    if not registry.is_ode(model):
        return None
    trained = model.ode.num_steps
    if auto:
        candidates = auto_steps.candidates(config.auto_grids, trained)
    else:
        candidates = [trained] if config.steps is None else parse_steps(config.steps, trained, expected=ONE_GRID)
        if len(candidates) != 1:
            raise UserError(f"--steps {config.steps!r} is invalid: expected {ONE_GRID}")
    for n in candidates:
        schedule(dataclasses.replace(model.ode, num_steps=n))
    return "auto" if auto else (None if config.steps is None else candidates[0])


def choose_steps(config, model, tokenizer) -> int:
    """--steps auto: N' scored on the run's validation data (qkvflow.evaluation.evaluate.score_grids)."""
    config = with_corpus(auto_steps.on_auto_split(config))
    ode = config.model.ode
    grid = depth.grid_points(ode, auto_steps.candidates(config.auto_grids, ode.num_steps))
    rows, _ = evaluate.score_grids(config, model, grid, tokenizer)
    chosen = auto_steps.mark_auto(rows, config.auto_tolerance, split=config.auto_split)
    print(chosen["summary"], file=sys.stderr, flush=True)
    return chosen["chosen"]["steps"]


def load(config):
    """(model, tokenizer) of the checkpoint: the trained model, or the fine-tuned one with LoRA merged."""
    return load_run_model(config, config.checkpoint)


def tokenizer_of(config):
    """The run's tokenizer (Hugging Face API), read before the model so that prompts are checked first."""
    tokenizer = data_checks.load_tokenizer(with_corpus(config).data)
    return tokenizer.as_hf_tokenizer() if hasattr(tokenizer, "as_hf_tokenizer") else tokenizer


def check_output(config, config_path=None) -> dict:
    """--output_jsonl: a file that can be written, not a file generate reads, not inside the checkpoint's run
    folder, an existing file only with --overwrite (`qkvflow.outputs.check_file`); checked before any work,
    as `qkvflow export` checks --output. Returns the rules for `qkvflow.outputs.writing_file`."""
    if config.output_jsonl is None:
        return {}
    protect = [("--prompts_file", config.prompts_file), ("--config_path", config_path)]
    outside = [("the run folder of --checkpoint", run_folder(config.checkpoint))]
    rules = {"overwrite": config.overwrite, "protect": protect, "outside": outside}
    outputs.check_file(config.output_jsonl, "--output_jsonl", **rules)
    return rules


def run(config, config_path=None) -> list:
    """The completions of `config`'s prompts, printed by the caller; also written to --output_jsonl. Every
    option and the output path are checked before the model is loaded."""
    options = sampling_options(config)
    prompts = read_prompts(config)
    if config.max_seqs < 1:
        raise UserError(f"--max_seqs {config.max_seqs} is invalid: expected an integer >= 1")
    if config.stream and len(prompts) > 1:
        raise UserError("--stream true takes one --prompt: expected --stream false with --prompts_file")
    steps = decoding_steps(config)
    if config.checkpoint is None:
        raise UserError("--checkpoint is missing: expected checkpoints/<run_id> or one of its step-N folders")
    rules = check_output(config, config_path)
    context = config.model.max_seq_len if config.model is not None else None
    if context is not None:
        decoding.encode_prompts(tokenizer_of(config), prompts, context, options.max_new_tokens)
    model, tokenizer = load(config)
    stream = None
    if config.stream:
        stream = lambda i, text: print(text, end="", flush=True)  # noqa: E731
    if steps == "auto":
        steps = choose_steps(config, model, tokenizer)
    completions = decoding.generate(
        model,
        tokenizer,
        prompts,
        options,
        steps=steps,
        sizes=decoding.EngineSizes(max_seqs=config.max_seqs),
        stream=stream,
    )
    if config.output_jsonl:
        rows = [{"prompt": c.prompt, "completion": c.text, "finish_reason": c.finish_reason, "tokens": c.tokens}
                for c in completions]  # fmt: skip
        text = "".join(json.dumps(row) + "\n" for row in rows)
        outputs.write_file(config.output_jsonl, "--output_jsonl", text, **rules)  # whole, then renamed into place
    return completions
