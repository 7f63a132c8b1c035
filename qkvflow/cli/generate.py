"""`qkvflow generate`: text from a checkpoint of `qkvflow train` or `qkvflow finetune`, with KV caches.

    qkvflow generate --config_path CFG --checkpoint CKPT --prompt TEXT [--max_new_tokens K] [--temperature T]
                     [--prompts_file F] [--output_jsonl F] [--steps N' | auto] [--top_p P] [--top_k K] [--stop S]
                     [--stop_token_ids '[ID, ...]'] [--seed S] [--stream true] [--dotted.key value ...]

CFG is the config the checkpoint was trained with: a training config (as `qkvflow export` reads it)
or a fine-tuning config (one with a `pretrained:` section; its fine-tuned, LoRA-merged model is
decoded). Decoding runs on Levanter's `InferenceEngine` (`qkvflow.inference`): a DiffEqFormer on its
fixed grid, or on `--steps N'` steps of the same solver (an integer, or relative to the trained N: 2N,
N/2); an adaptive solver is refused (pass `--model.ode.solver euler` or `--model.ode.adaptive false`).
`--steps auto` first scores the grids of --auto_grids on the run's validation data (or a corpus's
--auto_split), as `qkvflow eval --steps auto` does, and decodes on the one with the fewest vector-field
evaluations within --auto_tolerance nats of the lowest loss (qkvflow.evaluation.auto_steps); the
choice is printed on stderr. Temperature 0 (the default) is greedy.

Prints each completion (the generated text without the prompt) on stdout, one per prompt in order;
`--output_jsonl F` also writes one JSON object per prompt: prompt, completion, finish_reason, tokens.
`--stop S` ends a completion at the first S (excluded; `\\n` and `\\t` stand for newline and tab).
"""

import dataclasses
import json
import os
import sys
from dataclasses import dataclass, field
from typing import List, Optional

from qkvflow.cli import quiet_checkpoint_warnings
from qkvflow.errors import UserError
from qkvflow.evaluation import auto_steps
from qkvflow.training.config import TrainConfig
from qkvflow.training.finetune import FinetuneConfig, is_finetune_config


@dataclass
class GenerateOptions:
    checkpoint: Optional[str] = None
    """checkpoints/<run_id> or one of its step-N folders (the run of --config_path)."""
    prompt: Optional[str] = None
    """The text to continue (or --prompts_file)."""
    prompts_file: Optional[str] = None
    """A text file with one prompt per line (blank lines skipped), decoded in batches."""
    output_jsonl: Optional[str] = None
    """Also write one JSON object per prompt: prompt, completion, finish_reason, tokens."""
    max_new_tokens: int = 32
    temperature: float = 0.0
    """0: greedy (argmax); > 0: sample softmax(logits / temperature)."""
    top_p: float = 1.0
    """Nucleus sampling: the smallest set of tokens with this much probability."""
    top_k: Optional[int] = None
    """Sample among the k most likely tokens only."""
    stop: Optional[str] = None
    """End a completion before the first occurrence of this text (excluded; \\n: newline)."""
    stop_token_ids: List[int] = field(default_factory=list)
    """End a completion before the first of these tokens (excluded), e.g. '[0]'."""
    seed: int = 0
    """Sampling seed: the same seed, prompts and options give the same text."""
    steps: Optional[str] = None
    """N': decode a DiffEqFormer on this fixed grid instead of its trained ode.num_steps (e.g. 8, or 2N), or auto (the
    grid of --auto_grids with the fewest evaluations within --auto_tolerance of the lowest validation loss)."""
    auto_grids: str = auto_steps.GRIDS
    """With --steps auto: the candidate grids, as `qkvflow eval --steps` takes them."""
    auto_tolerance: float = auto_steps.TOLERANCE
    """With --steps auto: nats per token above the lowest candidate loss that the chosen grid may lose."""
    auto_split: Optional[str] = None
    """With --steps auto and a corpus: score the candidates on this split (selection, test or validation)."""
    max_seqs: int = 8
    """Sequences the engine decodes at once."""
    stream: bool = False
    """Print the text as it is generated (one prompt only)."""


@dataclass
class GenerateConfig(TrainConfig, GenerateOptions):
    """A training config plus the generation options."""


@dataclass
class FinetuneGenerateConfig(FinetuneConfig, GenerateOptions):
    """A fine-tuning config plus the generation options; `steps` is the fine-tuning config's (the depth
    M of the discretised model), so --steps N' does not apply."""


def read_config(argv: list[str]):
    from qkvflow import cli

    path, _ = cli.split_config_path(argv)
    cls = GenerateConfig
    if is_finetune_config(path):
        from qkvflow.cli.eval import refuse_grids

        refuse_grids(argv, path)  # --steps would set the fine-tuning config's depth M, not a grid N'
        cls = FinetuneGenerateConfig
    return cli.parse(cls, argv, "generate", required="the config the checkpoint was trained with (YAML)")


def _unescape(text: str) -> str:
    return text.replace("\\n", "\n").replace("\\t", "\t")


def sampling_options(config: GenerateOptions):
    from qkvflow.inference.generate import SamplingOptions

    options = SamplingOptions(
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


def read_prompts(config: GenerateOptions) -> list[str]:
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
    import dataclasses

    from qkvflow.cli.eval import check_auto, is_auto
    from qkvflow.evaluation.depth import parse_steps
    from qkvflow.inference.schedule import schedule
    from qkvflow.models import registry

    if isinstance(config, FinetuneConfig):
        return None  # a fine-tuning config's own `steps` is its depth M, not a grid N' (refuse_grids)
    model, auto = config.model, is_auto(config)
    check_auto(config)
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
        candidates = parse_steps(config.steps, trained) if config.steps is not None else [trained]
        if len(candidates) != 1:
            raise UserError(f"--steps {config.steps!r} is invalid: expected one grid N' (e.g. 8 or 2N) or auto")
    for n in candidates:
        schedule(dataclasses.replace(model.ode, num_steps=n))
    return "auto" if auto else (None if config.steps is None else candidates[0])


def choose_steps(config, model, tokenizer) -> int:
    """--steps auto: N' scored on the run's validation data (qkvflow.cli.eval.score_grids)."""
    from qkvflow.cli.eval import mark_auto, on_auto_split, score_grids
    from qkvflow.evaluation.depth import grid_points
    from qkvflow.training.session import with_corpus

    config = with_corpus(on_auto_split(config))
    ode = config.model.ode
    grid = grid_points(ode, auto_steps.candidates(config.auto_grids, ode.num_steps))
    rows, _ = score_grids(config, model, grid, tokenizer)
    chosen = mark_auto(rows, config.auto_tolerance, split=config.auto_split)
    print(chosen["summary"], file=sys.stderr, flush=True)
    return chosen["chosen"]["steps"]


def load(config):
    """(model, tokenizer) of the checkpoint: the trained model, or the fine-tuned one with LoRA merged."""
    from qkvflow.training.run_model import load_run_model

    return load_run_model(config, config.checkpoint)


def tokenizer_of(config):
    """The run's tokenizer (Hugging Face API), read before the model so that prompts are checked first."""
    from qkvflow.training import data_checks
    from qkvflow.training.session import with_corpus

    tokenizer = data_checks.load_tokenizer(with_corpus(config).data)
    return tokenizer.as_hf_tokenizer() if hasattr(tokenizer, "as_hf_tokenizer") else tokenizer


def run(config) -> list:
    from qkvflow.inference.generate import EngineSizes, encode_prompts, generate

    options = sampling_options(config)
    prompts = read_prompts(config)
    if config.max_seqs < 1:
        raise UserError(f"--max_seqs {config.max_seqs} is invalid: expected an integer >= 1")
    if config.stream and len(prompts) > 1:
        raise UserError("--stream true takes one --prompt: expected --stream false with --prompts_file")
    steps = decoding_steps(config)
    if config.checkpoint is None:
        raise UserError("--checkpoint is missing: expected checkpoints/<run_id> or one of its step-N folders")
    context = config.model.max_seq_len if config.model is not None else None
    if context is not None:
        encode_prompts(tokenizer_of(config), prompts, context, options.max_new_tokens)
    quiet_checkpoint_warnings()  # stdout and stderr stay the completions' and errors'
    model, tokenizer = load(config)
    stream = None
    if config.stream:
        stream = lambda i, text: print(text, end="", flush=True)  # noqa: E731
    if steps == "auto":
        steps = choose_steps(config, model, tokenizer)
    completions = generate(
        model, tokenizer, prompts, options, steps=steps, sizes=EngineSizes(max_seqs=config.max_seqs), stream=stream
    )
    if config.output_jsonl:
        with open(config.output_jsonl, "w", encoding="utf-8") as f:
            for c in completions:
                f.write(
                    json.dumps(
                        {"prompt": c.prompt, "completion": c.text, "finish_reason": c.finish_reason, "tokens": c.tokens}
                    )
                    + "\n"
                )
    return completions


def main(argv: list[str]) -> int:
    from qkvflow.cli import usage

    if usage.wants_help(argv):
        summary = "Text from a train or finetune checkpoint, KV-cached on Levanter's inference engine."
        own = {f.name for f in dataclasses.fields(GenerateOptions)}
        hide = tuple(
            f.name for f in dataclasses.fields(TrainConfig) if f.name not in own and f.name not in usage.SECTIONS
        )
        print(usage.short_help("qkvflow generate", GenerateConfig, summary, hide=hide))
        return 0
    config = read_config(usage.full_listing_args(argv))
    completions = run(config)
    for c in completions:
        if config.stream:
            print()
        else:
            print(c.text)
    sys.stdout.flush()
    return 0
