"""The documentation checked as a reader would use it, in three parts.

* Paths. The paths that README.md, docs/*.md and the folder READMEs on the site name exist: every
  `--config_path FILE` of a command and every file of the repository they point at (configs/, docs/,
  benchmarks/, launch/, qkvflow/, tests/), so a renamed or removed file cannot leave a command in the docs
  that fails at its first argument. Files that a command writes (runs/, checkpoints/, exports/,
  benchmarks/results/ made by a rerun) are not checked: only paths under the repository's own folders,
  without placeholders (<run_id>, $VAR, {name}, *).
* Commands. Every `qkvflow ...` command line there parses with its verb's own parser, so a renamed or
  removed flag fails as a renamed path does.
* Lists. Every list renders as a list on the site: Python-Markdown (mkdocs) reads a list only after a
  blank line (GitHub also after a paragraph), and numbers an ordered list from 1 whatever its first
  number, so a step list broken by an unindented code block restarts at "1." (`list_problems`).
* Figures. A number quoted away from where it was measured is a link to the section or record that
  measured it, its text starting with the number (`[1.22x](performance.md#collectives)`), and every
  number of the link's text is stated in that section (`figure_problems`), so a quote cannot drift from
  its measurement (docs/contributing.md, "The documentation").
* The site. `mkdocs build --strict` builds it (mkdocs.yml), so a broken link, a page left out of the nav
  or a docstring reference that resolves nowhere fails."""

import os
import re
import subprocess
import sys
from pathlib import Path
from pydoc_data.topics import topics

import pytest
from markdown.extensions.toc import slugify, unique

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "launch/README.md", ROOT / "configs/README.md", ROOT / "benchmarks/README.md"]  # on the site too
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *PAGES]
FOLDERS = ("configs", "docs", "benchmarks", "launch", "qkvflow", "tests")
# a path runs on through placeholders (`a_{x,y}.yaml`, `<cfg>`), which PLACEHOLDER then skips whole
PATH = re.compile(r"(?<![\w/.~-])((?:%s)/[\w./{}<>$*,-]*[\w}>*])" % "|".join(FOLDERS))
CONFIG_PATH = re.compile(r"--config_path[= ]+([^\s`'\"),\]]+)")
PLACEHOLDER = re.compile(r"[<>${}*]|(^|/)[A-Z_]+(\.|/|$)")  # <run_id>, $VAR, {name}, *, VERB.py
TO_BE_WRITTEN = {"qkvflow/models/my_family.py"}  # docs/architecture.md: the file a new model family adds
NOT_OURS = {"qkvflow/train_lm.py"}  # configs/README.md: the authors' training script (SDML-KU/qkvflow)


def _named(text: str) -> set[str]:
    found = set(PATH.findall(text)) | set(CONFIG_PATH.findall(text))
    return {p.rstrip(".") for p in found if not PLACEHOLDER.search(p)}


def _exists(path: str, doc: Path) -> bool:
    """`path` relative to the repository or to the doc; `tests/train_utils.reference_run` names a
    function of tests/train_utils.py."""
    module = re.sub(r"\.\w+$", ".py", path)
    return any((base / p).exists() for base in (ROOT, doc.parent) for p in (path, module))


def test_the_parser_finds_paths_and_skips_placeholders():
    text = (
        "run `qkvflow train --config_path configs/quickstart.yaml` and see docs/own_text.md, "
        "tests/test_train.py::test_x, --config_path=my.yaml, configs/<name>.yaml, checkpoints/run/step-3, "
        "qkvflow/cli/VERB.py, benchmarks/configs/quality_{ode,gpt2}.yaml."
    )
    assert _named(text) == {"configs/quickstart.yaml", "docs/own_text.md", "tests/test_train.py", "my.yaml"}


@pytest.mark.parametrize("doc", DOCS, ids=[str(d.relative_to(ROOT)) for d in DOCS])
def test_every_path_the_docs_name_exists(doc):
    written = {"benchmarks/results", "runs", "checkpoints", "exports", "sweeps", "tasks"}
    missing = []
    for path in sorted(_named(doc.read_text())):
        if path.split("/")[0] in written or path.startswith("benchmarks/results/"):
            continue
        if path.split("/")[0] not in FOLDERS:  # a --config_path of the user's own (my.yaml) or one a step wrote
            continue
        if path not in TO_BE_WRITTEN | NOT_OURS and not _exists(path, doc):
            missing.append(path)
    assert not missing, f"{doc.relative_to(ROOT)} names paths that do not exist: {missing}"


# Every `qkvflow ...` command line of the docs parses with its verb's own parser (qkvflow.cli.startup.dryparse):
# a renamed or removed flag, or a value of the wrong type, fails here as a renamed path fails above.
FENCE = re.compile(r"^\s*(```|~~~)")
PROMPT = re.compile(r"^(?:\$ )?(?:[\w./-]*/)?qkvflow (\S.*)$")  # `qkvflow ...`, `.venv/bin/qkvflow ...`
OUTPUT_LINE = re.compile(r"^[\w-]+( [\w-]+)?: ")  # `qkvflow tokenizer: error: ...`, printed, not typed
STAND_INS = {  # placeholders of the docs -> a value the verb parses; a config must exist (main checks it)
    "CFG": "configs/quickstart.yaml",
    "CONFIG": "configs/quickstart.yaml",
    "CKPT": "checkpoints/quickstart",
    "<CKPT>": "checkpoints/quickstart",
    "RUN_ID": "run",
    "DIR": "out",
    "W": "work",
    "N": "4",
    "M": "4",
    "STUDY.yaml": "benchmarks/compare/tinyshakespeare.yaml",
}
FINETUNE_CONFIG = "configs/finetune/quickstart_lora.yaml"


def command_lines(text: str) -> list[tuple[int, str]]:
    """(line number, the arguments after `qkvflow`) of every command line: each line of a fenced block
    that starts with `qkvflow` (continued over trailing backslashes), and each inline `qkvflow VERB ...`
    code span that gives the verb an argument (a bare `qkvflow train` names the verb; it is no command)."""
    found, fenced, held = [], False, None
    for number, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if fenced:
            stripped = line.strip()
            if held is not None:
                held[1] += " " + stripped.rstrip("\\")
            elif (m := PROMPT.match(stripped)) and not OUTPUT_LINE.match(m.group(1)):
                held = [number, m.group(1).rstrip("\\")]
            if held is not None and not stripped.endswith("\\"):
                found.append(tuple(held))
                held = None
        else:
            found += [(number, m.group(1)) for m in re.finditer(r"`qkvflow ([^`]+)`", line)]
    return [(n, c) for n, c in found if not OUTPUT_LINE.match(c)]


def as_argv(command: str) -> list[str] | None:
    """The argv a reader would type for a documented `command`: the shell's words up to a comment, pipe
    or `&&`; `[--optional ...]` brackets dropped, keeping what they hold; `...` and `[--dotted.key value
    ...]` dropped; the first of `a|b` alternatives; placeholders replaced (STAND_INS). None when the line
    names a verb or mode but gives it nothing to parse."""
    import shlex

    command = re.sub(r"\[--dotted\.key value \.\.\.\]|(?<!\S)\.\.\.(?!\S)", " ", command)
    lexer = shlex.shlex(command, posix=True, punctuation_chars="|&;")
    lexer.whitespace_split, lexer.commenters = True, "#"
    words = []
    for word in lexer:
        if word in ("|", "||", "&&", ";", "&"):
            break
        words.append(word)
    words = [w[1:] if w.startswith("[-") else w for w in words]  # `[--ode]`, not a YAML list `'[a.jsonl]'`
    words = [w[:-1] if w.endswith("]") and w.count("]") > w.count("[") else w for w in words]
    words = [w.split("|")[0] if w.startswith("-") or re.fullmatch(r"[\w.,|]+", w) else w for w in words if w]
    words = [STAND_INS.get(w, w) for w in words]
    if not words or words[0].isupper():  # `qkvflow VERB --help`: any verb
        return None
    if words[:1] == ["bench"]:
        return words if len(words) > 2 else None
    return words if len(words) > 1 else None


def completed(argv: list[str]) -> list[str]:
    """A documented fragment (`qkvflow eval --steps auto`, `qkvflow analyze spectra --num_times 49`)
    with what the verb needs besides: the quickstart's config, or the fine-tuning example's."""
    verb = argv[0]
    analysis = verb == "analyze" and argv[1:2] in (["spectra"], ["lyapunov"])
    needs_config = verb in ("train", "describe", "plan", "eval", "generate", "export", "finetune", "sweep") or analysis
    if argv[:2] == ["bench", "compare"]:
        study = [] if argv[2:3] and not argv[2].startswith("-") else [STAND_INS["STUDY.yaml"]]
        return argv[:2] + study + argv[2:] + ([] if "--workdir" in argv else ["--workdir", STAND_INS["W"]])
    if argv[:2] == ["bench", "speed"] and not any(a.startswith("--config_path") for a in argv):
        return argv + ["--config_path", "benchmarks/configs/speed.yaml"]
    if not needs_config or any(a.startswith("--config_path") for a in argv):
        return argv
    extra = ["--config_path", FINETUNE_CONFIG if verb in ("finetune", "sweep") else STAND_INS["CFG"]]
    if verb in ("export", "eval", "generate") or analysis:
        extra += [] if "--checkpoint" in argv else ["--checkpoint", STAND_INS["CKPT"]]
    if verb == "export" and "--output" not in argv:
        extra += ["--output", STAND_INS["DIR"]]
    if argv[1:2] == ["lyapunov"] and "--text" not in argv:
        extra += ["--text", "a"]
    return argv + extra


def documented_commands() -> list[tuple[str, str]]:
    return [
        (f"{doc.relative_to(ROOT)}:{n}", command)
        for doc in DOCS
        for n, command in command_lines(doc.read_text())
        if as_argv(command) is not None
    ]


def test_the_command_extraction_reads_what_a_reader_would_type():
    text = "\n".join(
        [
            "run `qkvflow train` first, then `qkvflow eval --steps auto`; `qkvflow bench compare` alone.",
            "```bash",
            "qkvflow export --config_path CFG --checkpoint <CKPT> \\",
            "    --steps 8 [--ode] [--overwrite]   # discretise",
            "qkvflow tokenizer: error: --files: 'x' is not UTF-8 text",
            "qkvflow tokenizer --files A.txt ... --output DIR [--kind bpe|char] | tee log",
            "```",
        ]
    )
    lines = command_lines(text)
    assert [n for n, _ in lines] == [1, 1, 1, 3, 6]
    argvs = [as_argv(c) for _, c in lines]
    assert argvs[0] is None and argvs[2] is None
    assert argvs[1] == ["eval", "--steps", "auto"]
    assert argvs[3] == [
        "export", "--config_path", "configs/quickstart.yaml", "--checkpoint", "checkpoints/quickstart",
        "--steps", "8", "--ode", "--overwrite",
    ]  # fmt: skip
    assert argvs[4] == ["tokenizer", "--files", "A.txt", "--output", "out", "--kind", "bpe"]
    assert completed(argvs[1]) == [
        "eval", "--steps", "auto", "--config_path", "configs/quickstart.yaml", "--checkpoint", "checkpoints/quickstart"
    ]  # fmt: skip


def test_a_renamed_flag_is_caught(monkeypatch):
    """The check itself: a flag the verb does not have, or a value it cannot read, is refused with the
    verb's line; the same command with the real flag parses to the value given."""
    from qkvflow.cli.startup.dryparse import parse_only
    from qkvflow.errors import UserError

    monkeypatch.chdir(ROOT)
    config = parse_only(["train", "--config_path", "configs/quickstart.yaml", "--trainer.num_train_steps", "7"])
    assert config.trainer.num_train_steps == 7
    with pytest.raises(UserError, match="num_train_step"):
        parse_only(["train", "--config_path", "configs/quickstart.yaml", "--trainer.num_train_step", "7"])
    with pytest.raises(UserError, match="--max_new_token"):
        parse_only(completed(["generate", "--max_new_token", "3"]))
    with pytest.raises(UserError, match="--layers"):
        parse_only(completed(["export", "--layers", "8"]))
    with pytest.raises(UserError, match="invalid int value"):
        parse_only(["bench", "compare", "s.yaml", "--workdir", "w", "--iters", "many"])
    args = parse_only(["bench", "compare", "s.yaml", "--workdir", "w", "--iters", "9"])
    assert (args.study, args.workdir, args.iters) == ("s.yaml", "w", 9)
    namespace, train_config = parse_only(completed(["export", "--steps", "8", "--model.ode.num_steps", "6"]))
    assert namespace.steps == "8" and train_config.model.ode.num_steps == 6  # export takes 8, 2N or N/2


@pytest.mark.parametrize("where, command", documented_commands(), ids=[w for w, _ in documented_commands()])
def test_every_documented_command_parses(where, command, monkeypatch):
    from qkvflow.cli.startup.dryparse import parse_only
    from qkvflow.errors import UserError

    argv = completed(as_argv(command))
    monkeypatch.chdir(ROOT)
    try:
        try:
            parse_only(argv)
        except UserError as e:  # `qkvflow eval --tasks` in a sentence names the flag: given a value, it parses
            named = as_argv(command)
            if "expected one argument" not in str(e) or not named[-1].startswith("--"):
                raise
            parse_only(completed(named + ["1"]))
    except UserError as e:
        pytest.fail(f"{where}: `qkvflow {command}` does not parse: {e}")


# Python-Markdown's list rules (markdown.blockprocessors: OListProcessor/UListProcessor, tab_length 4, and
# `lazy_ol`, on by default, which ignores an ordered list's first number): an item is a marker after at most 3
# spaces; a list begins only in a new block (after a blank line, or right after a heading); after a blank line
# only lines indented by 4 or more stay in the list.
LIST_ITEM = re.compile(r"^ {0,3}(?:(\d+)\.|[-*+])[ \t]+\S")
FENCE_OPEN = re.compile(r"^(\s*)(```|~~~)")


def list_problems(text: str) -> list[tuple[int, str]]:
    """(line number, what is wrong) for each list that mkdocs renders other than a reader of the Markdown
    expects, outside fenced code blocks: an item right after a paragraph line (no blank line before the
    list: it renders as text of that paragraph), and an ordered list whose first item is not 1 (it renders
    from 1: a step's code block that is not indented under its item ends the list)."""
    problems, fence, in_list, previous = [], None, False, ""
    for number, line in enumerate(text.splitlines(), 1):
        opening = FENCE_OPEN.match(line)
        if fence is not None:  # inside a fenced block: only its closing fence counts
            fence = None if opening and opening.group(2) == fence else fence
            continue
        if opening:
            fence, in_list, previous = opening.group(2), in_list and opening.group(1) != "", line
            continue
        item = LIST_ITEM.match(line)
        if item and not in_list:
            if previous.strip() and not previous.lstrip().startswith("#"):
                problems.append((number, "list item right after a paragraph line: add a blank line before the list"))
            elif item.group(1) is not None and item.group(1) != "1":
                where = "indent the code block above under its item"
                problems.append((number, f"ordered list starts at {item.group(1)} but renders from 1: {where}"))
        if item:
            in_list = True
        elif line.strip() and not previous.strip() and not line.startswith("    "):
            in_list = False
        previous = line
    return problems


def test_the_list_scanner_flags_what_mkdocs_renders_as_text_or_renumbers():
    text = "\n".join(
        [
            "Steps:",  # 1
            "1. first",  # 2: no blank line before it
            "",
            "1. a list",  # 4
            "continued lazily",
            "2. second item",  # 6: in the list
            "",
            "```bash",
            "- not markdown: 3. inside a fence",  # 9
            "```",
            "",
            "2. after an unindented code block",  # 12: a new list, rendered from 1
            "",
            "- item",
            "    ```yaml",
            "    a: 1",
            "    ```",
            "",
            "    indented paragraph of the item",
            "- next item",  # 20: still the same list
            "",
            "  two-space text leaves the list",
            "- so this item follows a paragraph",  # 23
            "## Heading",
            "- a list right under a heading",  # 25: Python-Markdown splits the heading off
        ]
    )
    assert [n for n, _ in list_problems(text)] == [2, 12, 23]
    assert "starts at 2" in dict(list_problems(text))[12]


@pytest.mark.parametrize("doc", DOCS, ids=[str(d.relative_to(ROOT)) for d in DOCS])
def test_every_list_renders_as_a_list(doc):
    problems = [f"{doc.relative_to(ROOT)}:{n}: {what}" for n, what in list_problems(doc.read_text())]
    assert not problems, "\n".join(problems)


# A quoted figure: a link whose text starts with a number, `[0.89x](page.md#section)` or a record's README.
FIGURE_LINK = re.compile(r"(?<!!)\[([+-]?\d(?:[^\[\]]|\[[^\[\]]*\])*)\]\(([^)\s#]*)(?:#([^)\s]+))?\)")
NUMBER = re.compile(r"\d+(?:,\d{3})*(?:\.\d+)?")  # 1,301 and 0.89 and 12.3 whole; a sign is not part
HEADING = re.compile(r"^(#{1,6})\s+(.+?)\s*#*\s*$")


def sections(text: str) -> dict[str, str]:
    """Each heading's anchor -> its section's text: from the heading to the next heading of its level or
    above, outside fenced blocks. Anchors as the site makes them (Python-Markdown's toc: `slugify`, and
    `_1`, `_2` after a repeated one)."""
    lines, headings, fenced = text.splitlines(), [], False
    for number, line in enumerate(lines):
        if FENCE.match(line):
            fenced = not fenced
        elif not fenced and (m := HEADING.match(line)):
            headings.append((number, len(m.group(1)), m.group(2)))
    found, used = {}, set()
    for k, (start, level, title) in enumerate(headings):
        end = next((n for n, deeper, _ in headings[k + 1 :] if deeper <= level), len(lines))
        found[unique(slugify(title, "-"), used)] = "\n".join(lines[start:end])
    return found


def figure_problems(doc: Path) -> list[str]:
    """(line: what is wrong) for each quoted figure of `doc` whose numbers the section it links does not
    state, and each that links no Markdown section."""
    problems, fenced = [], False
    for number, line in enumerate(doc.read_text().splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        for figure, path, anchor in [] if fenced else FIGURE_LINK.findall(line):
            target = (doc.parent / path).resolve() if path else doc
            target = target / "README.md" if target.is_dir() else target
            if target.suffix != ".md" or not target.is_file():
                problems.append(f"{number}: [{figure}] links {path!r}, not a page or record")
                continue
            text = target.read_text()
            section = sections(text).get(anchor) if anchor else text
            if section is None:
                problems.append(f"{number}: [{figure}] links #{anchor}, no section of {path or doc.name}")
                continue
            stated = set(NUMBER.findall(section))
            missing = [n for n in NUMBER.findall(figure) if n not in stated]
            if missing:
                where = f"{path or doc.name}{'#' + anchor if anchor else ''}"
                problems.append(f"{number}: [{figure}] quotes {', '.join(missing)}, which {where} does not state")
    return problems


def test_a_quoted_figure_is_checked_against_the_section_it_links(tmp_path):
    """The check itself, on pages written here: a figure its section states passes, in any of its
    sections' numbers; one changed digit, a figure stated only in another section, or an anchor to no
    section is reported with its line."""
    (tmp_path / "record").mkdir()
    (tmp_path / "record/README.md").write_text("# Run\n\n221,761 tokens/s (19.3%); ratio **0.78**.\n")
    (tmp_path / "page.md").write_text(
        "# Page\n\n## Speed\n\nMeasured: 0.89 at 32 x 1024.\n\n### Detail\n\n1.22x\n\n"
        "## Memory\n\n5.84 GiB\n\n```text\n## Not a heading\n```\n"
    )
    (tmp_path / "quotes.md").write_text(
        "\n".join(
            [
                "[0.89x at 32 x 1024](page.md#speed) and [1.22x](page.md#speed), [221,761 (19.3%)](record/)",  # 1
                "[0.88x](page.md#speed)",  # 2: one digit changed
                "[5.84 GiB](page.md#speed)",  # 3: stated in another section
                "[0.89](page.md#not-a-heading) [0.78 [19.3, 0.78]](record/README.md) ![5.84](page.md#speed)",  # 4
                "[21,761](record/README.md) [speed](page.md#speed) [0.78](record/data.json)",  # 5
            ]
        )
    )
    assert figure_problems(tmp_path / "quotes.md") == [
        "2: [0.88x] quotes 0.88, which page.md#speed does not state",
        "3: [5.84 GiB] quotes 5.84, which page.md#speed does not state",
        "4: [0.89] links #not-a-heading, no section of page.md",
        "5: [21,761] quotes 21,761, which record/README.md does not state",
        "5: [0.78] links 'record/data.json', not a page or record",
    ]
    assert list(sections("## A b\n\n## A b\n### `c` (d, e)\n")) == ["a-b", "a-b_1", "c-d-e"]


@pytest.mark.parametrize("doc", DOCS, ids=[str(d.relative_to(ROOT)) for d in DOCS])
def test_every_quoted_figure_is_stated_where_it_links(doc):
    problems = [f"{doc.relative_to(ROOT)}:{p}" for p in figure_problems(doc)]
    assert not problems, "\n".join(problems)


def test_the_own_text_example_makes_its_text_from_what_every_python_has(tmp_path):
    """docs/own_text.md's step 0 runs in an empty folder (a fresh clone has nothing beside it): it writes
    four non-empty .txt files that together hold every `help()` topic page of this Python."""
    block = (ROOT / "docs/own_text.md").read_text().split("```bash\n", 1)[1].split("```", 1)[0]
    step0 = block.split("\n# 1.", 1)[0]
    assert "../" not in step0 and "qkvflow" not in step0, step0
    env = {**os.environ, "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"]}
    subprocess.run(["bash", "-euc", step0], cwd=tmp_path, env=env, check=True)
    files = sorted((tmp_path / "mytext").iterdir())
    assert [f.name for f in files] == [f"part_{i}.txt" for i in range(4)]
    texts = [f.read_text(encoding="utf-8") for f in files]
    assert all(texts) and all(page in "".join(texts) for page in topics.values())


def test_the_documentation_site_builds_strict(tmp_path):
    """`mkdocs build --strict` (mkdocs.yml), offline, as CI would publish it: a broken link or anchor, a
    page missing from the nav, a docstring cross-reference that resolves nowhere or a failing hook ends
    the build. The pages kept outside docs/ come with their links pointed at the site's pages and files, a
    results README that a page links to is a page too, and the configuration page is generated
    (tests/test_reference.py checks its rows). The `mkdocs` command shows DeprecationWarnings in its log,
    with their stacks: the build logs none (the hook filters haliax's import-time one, docs/hooks/site.py)."""
    site = tmp_path / "site"
    mkdocs = "from mkdocs.__main__ import cli; cli()"  # the `mkdocs` command (`-m mkdocs` would log to `__main__`)
    built = subprocess.run(
        [sys.executable, "-c", mkdocs, "build", "--strict", "--site-dir", str(site)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**{k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert built.returncode == 0, built.stderr
    assert "DeprecationWarning" not in built.stdout + built.stderr, built.stderr
    index = (site / "index.html").read_text()
    assert 'href="install.html"' in index and 'href="docs/install.md"' not in index  # README's link, on the site
    assert "<code>model.ode.num_steps</code>" in (site / "config.html").read_text()
    assert 'src="repo/benchmarks/results/depth_at_inference.png"' in (site / "evaluate.html").read_text()
    assert (site / "repo/benchmarks/results/depth_at_inference.png").is_file()
    record = (site / "repo/benchmarks/results/issue34_cpu_2026-11-26/index.html").read_text()  # a linked README
    assert 'href="../../../../benchmarks_reference.html#speed-on-the-cpu"' in record  # its link, from where it lives
    assert "qkvflow.nn.time_dependent.TimeDependentWeight" in (site / "api/nn.html").read_text()


def test_no_documented_train_command_changes_the_run_of_its_config(monkeypatch):
    """A documented `qkvflow train` that sets a key a resume may not change (qkvflow.runs.run_record)
    names a `trainer.id` of its own. Run after its config's own command (README command 1 for the
    quickstart), it would otherwise be refused, or, before runs recorded their config, have trained or
    evaluated another model under that run's id (issue 62: docs/training.md's first example did)."""
    from qkvflow.runs import configfile, run_record
    from qkvflow.runs.config import TrainConfig

    monkeypatch.chdir(ROOT)
    own, runs = {}, {}
    for where, command in documented_commands():
        argv = completed(as_argv(command))
        if argv[0] != "train" or {"--help", "--help-all", "-h"} & set(argv):
            continue
        config = configfile.parse(TrainConfig, argv[1:], "train")
        path = next(a.partition("=")[2] or argv[i + 1] for i, a in enumerate(argv) if a.startswith("--config_path"))
        if path not in runs:
            runs[path] = configfile.parse(TrainConfig, ["--config_path", path], "train")
        base = runs[path]
        own[where] = config.trainer.id != base.trainer.id
        if not own[where]:
            changes = run_record.changed(run_record.snapshot(base), run_record.snapshot(config))
            assert not changes, f"{where}: `qkvflow {command}` changes run {base.trainer.id!r} of {path}: {changes}"
    first = min((w for w in own if w.startswith("docs/training.md:")), key=lambda w: int(w.split(":")[1]))
    assert own[first]  # training.md's first example: another model and batch, under an id of its own
    assert sum(not o for o in own.values()) >= 5, own  # commands that resume or extend their config's own run
