"""`qkvflow generate`: text from a checkpoint of `qkvflow train` or `qkvflow finetune`, with KV caches.

    qkvflow generate --config_path CFG --checkpoint CKPT --prompt TEXT [--max_new_tokens K] [--temperature T]
                     [--prompts_file F] [--output_jsonl F [--overwrite]] [--steps N' | auto] [--top_p P] [--top_k K] [--stop S]
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
`--output_jsonl F` also writes one JSON object per prompt: prompt, completion, finish_reason, tokens
(F is checked before any work, as every output file (qkvflow.outputs): not a folder, outside the
checkpoint's run folder and the repository's tracked folders, an existing file only with --overwrite;
it is written whole into a temporary file beside F and renamed onto it).
`--stop S` ends a completion at the first S (excluded; `\\n` and `\\t` stand for newline and tab).
This module parses and dispatches; the work is qkvflow.inference.completions.
"""

import dataclasses
import sys
from dataclasses import dataclass, field
from typing import List, Optional

from qkvflow.cli.eval import refuse_grids
from qkvflow.cli.startup import usage
from qkvflow.cli.startup.console import quiet_checkpoint_warnings
from qkvflow.evaluation import auto_steps
from qkvflow.inference import completions
from qkvflow.runs import configfile
from qkvflow.runs.config import TrainConfig
from qkvflow.runs.finetune_config import FinetuneConfig, is_finetune_config


@dataclass
class GenerateOptions:
    checkpoint: Optional[str] = None
    """checkpoints/<run_id> or one of its step-N folders (the run of --config_path)."""
    prompt: Optional[str] = None
    """The text to continue (or --prompts_file)."""
    prompts_file: Optional[str] = None
    """A text file with one prompt per line (blank lines skipped), decoded in batches."""
    output_jsonl: Optional[str] = None
    """Also write one JSON object per prompt: prompt, completion, finish_reason, tokens (a file path, checked
    before any work; not inside the checkpoint's run folder or the repository's tracked folders)."""
    overwrite: bool = False
    """Replace an existing output file or an earlier qkvflow output folder (refused without it)."""
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
    path, _ = configfile.split_config_path(argv)
    cls = GenerateConfig
    if is_finetune_config(path):
        refuse_grids(argv, path)  # --steps would set the fine-tuning config's depth M, not a grid N'
        cls = FinetuneGenerateConfig
    return configfile.parse(cls, argv, "generate", required="the config the checkpoint was trained with (YAML)")


def main(argv: list[str]) -> int:
    if usage.wants_help(argv):
        summary = "Text from a train or finetune checkpoint, KV-cached on Levanter's inference engine."
        own = {f.name for f in dataclasses.fields(GenerateOptions)}
        hide = tuple(
            f.name for f in dataclasses.fields(TrainConfig) if f.name not in own and f.name not in usage.SECTIONS
        )
        print(usage.short_help("qkvflow generate", GenerateConfig, summary, hide=hide))
        return 0
    config_path, _ = configfile.split_config_path(argv)
    config = read_config(usage.full_listing_args(argv))
    quiet_checkpoint_warnings()  # stdout and stderr stay the completions' and errors'
    written = completions.run(config, config_path)
    for c in written:
        if config.stream:
            print()
        else:
            print(c.text)
    sys.stdout.flush()
    return 0
