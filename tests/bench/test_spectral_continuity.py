"""benchmarks/spectral_continuity.py: reads each model's chosen runs from a compare study's report, and
reports V(ODE) - V(GPT-2) paired by seed. Models are random (tests/analysis/builders.filled) and handed
in for the checkpoints; the GPT-2 row is recomputed here from its layer weights."""

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
from levanter.models.gpt2 import Gpt2Config

from qkvflow.integrate.config import OdeConfig
from qkvflow.models.diffeqformer import DiffEqFormerGpt2Config
from tests.analysis.builders import filled

_spec = importlib.util.spec_from_file_location(
    "sc", Path(__file__).parents[2] / "benchmarks" / "spectral_continuity.py"
)
sc = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sc)

GPT2 = Gpt2Config(max_seq_len=8, hidden_dim=6, num_heads=2, num_layers=3)
ODE = DiffEqFormerGpt2Config(max_seq_len=8, hidden_dim=6, num_heads=2, time_embed_dim=4, ode=OdeConfig(3))


def _variation_by_hand(q: np.ndarray, k: np.ndarray) -> float:
    """V of the QK circuit over depth for q, k [depth, heads, embed, head_size]: the nonzero eigenvalues
    of Q_h K_h^T per head, real parts sorted descending, mean L1 step over the mean L1 size."""
    s = []
    for qs, ks in zip(q, k):
        parts = [np.linalg.eigvals(a @ b.T) for a, b in zip(qs, ks)]
        s.append(np.concatenate([-np.sort(-np.real(p[np.argsort(-np.abs(p))[: q.shape[-1]]])) for p in parts]))
    s = np.array(s)
    return np.abs(np.diff(s, axis=0)).sum(axis=1).mean() / np.abs(s).sum(axis=1).mean()


def _gpt2_qk(model):
    attn = model.transformer.blocks.stacked.attn.c_attn.weight  # [layers, embed, qkv, heads, head_size]
    w = np.asarray(attn.rearrange(("layers", "qkv", "heads", "embed", "head_size")).array)
    return w[:, 0], w[:, 1]


def _ode_qk(model, times):
    """Q(t), K(t) at `times`, from the generator."""
    ws = [model.generator(t) for t in times]
    q, k = ([np.asarray(w[n].rearrange(("heads", "embed", "head_size")).array) for w in ws] for n in "qk")
    return np.array(q), np.array(k)


def test_pairs_the_chosen_runs_by_seed(tmp_path, monkeypatch):
    report = {"seeds": [0, 1], "models": {"gpt2": {"best_learning_rate": 0.002}, "ode": {"best_learning_rate": 0.001}}}
    (tmp_path / "report.json").write_text(json.dumps(report))
    models = {f"gpt2-lr0.002-s{s}": filled(GPT2, seed=s) for s in (0, 1)}
    models |= {f"ode-lr0.001-s{s}": filled(ODE, seed=10 + s) for s in (0, 1)}
    asked = []

    def load(workdir, rid):
        asked.append(rid)
        return models[rid]

    monkeypatch.setattr(sc, "_model", load)
    argv = ["--workdir", str(tmp_path), "--report", str(tmp_path / "report.json"), "--out", str(tmp_path / "out")]
    assert sc.main(argv) == 0
    assert sorted(asked) == sorted(models)
    result = json.loads((tmp_path / "out" / "result.json").read_text())
    gpt2, ode = result["runs"]["gpt2"], result["runs"]["ode"]
    for s in (0, 1):
        assert gpt2[str(s)]["qk"] == pytest.approx(
            _variation_by_hand(*_gpt2_qk(models[f"gpt2-lr0.002-s{s}"])), rel=1e-4
        )
        # the ODE at the times its Euler solve uses: 0, 1/3, 2/3 (not 1)
        by_hand = _variation_by_hand(*_ode_qk(models[f"ode-lr0.001-s{s}"], (0.0, 1 / 3, 2 / 3)))
        assert ode[str(s)]["qk"] == pytest.approx(by_hand, rel=1e-4)
        assert gpt2[str(s)]["points"] == 3 and ode[str(s)]["points"] == 3  # layers; Euler's 3 times
        assert ode[str(s)]["qk_path_ratio_61_to_4"] > 0.5
    diffs = [ode[str(s)]["ov"] - gpt2[str(s)]["ov"] for s in (0, 1)]
    assert result["ov_difference"]["mean"] == pytest.approx(np.mean(diffs), rel=1e-12)
    low, high = result["ov_difference"]["ci95"]
    half = 12.706 * np.std(diffs, ddof=1) / np.sqrt(2)  # t(0.975, 1 degree of freedom)
    assert (low, high) == pytest.approx((np.mean(diffs) - half, np.mean(diffs) + half), rel=1e-4)
    assert "| QK |" in (tmp_path / "out" / "result.md").read_text()
