"""`--help` of every verb (qkvflow.cli.startup.usage): the page it points to, and the model types it lists."""

import re
from pathlib import Path

import pytest

from qkvflow.cli import VERBS, main
from qkvflow.cli.startup import usage

ROOT = Path(__file__).resolve().parents[1]
OWN_PAGES = sorted(set(VERBS) - {"bench"})
"""Every verb with one --help; `qkvflow bench` is an overview of modes, each with its own parser."""


def _help(capsys, *argv: str) -> str:
    try:
        assert main([*argv, "--help"]) == 0
    except SystemExit as exit:  # argparse's verbs (export, analyze) exit after printing
        assert exit.code == 0
    return capsys.readouterr().out


@pytest.mark.parametrize("verb", OWN_PAGES)
def test_each_verbs_help_ends_with_its_own_page(capsys, verb):
    """The last line names one file of the repository, and that page documents `qkvflow <verb>`."""
    assert sorted(usage.REFERENCE) == OWN_PAGES
    last = _help(capsys, verb).strip().splitlines()[-1]
    match = re.fullmatch(r"reference: (\S+)", last)
    assert match, last
    page = ROOT / match.group(1)
    assert page.is_file(), page
    assert f"qkvflow {verb}" in page.read_text(), f"{page} does not mention qkvflow {verb}"


def test_the_model_section_lists_every_registered_type_and_the_variant(capsys, monkeypatch):
    """Generated from qkvflow.models.registry: every family, one declared here for the test included. (The
    command line prints the text rendered into qkvflow/cli/startup/table.json, which tests/test_cli_early.py pins
    to what `table.render_help` renders now.)"""
    from qkvflow.cli.startup import table
    from qkvflow.models import registry
    from qkvflow.models.flavour import GPT2

    monkeypatch.setitem(
        registry._FAMILIES, "zz_declared_here", registry.Family("zz_declared_here", object, GPT2, False)
    )
    out = table.render_help(["train"])
    section = re.search(r"^  model {2,}(.*?)^  \w", out, re.MULTILINE | re.DOTALL)
    assert section, out
    words = set(re.findall(r"[\w.]+", section.group(1)))
    assert {f.name for f in registry.families()} <= words, words
    assert "variant" in words and "official" in words
