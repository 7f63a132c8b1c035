import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(*args, check=True):
    return subprocess.run([sys.executable, "-m", "qkvflow", *args], cwd=ROOT, capture_output=True, text=True, check=check)


def test_help_lists_verbs():
    out = run("--help").stdout
    assert "train" in out and "describe" in out


def test_unknown_verb_fails_with_usage():
    proc = run("frobnicate", check=False)
    assert proc.returncode == 2 and "unknown verb 'frobnicate'" in proc.stderr


def test_describe_applies_overrides():
    proc = run("describe", "--config_path", "configs/models/medium_d144.yaml", "--model.time_embed_dim", "20")
    out = json.loads(proc.stdout)
    assert 295e6 < out["total_params"] < 310e6
    assert out["ode_evaluations"] == 24
