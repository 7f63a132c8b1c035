"""Spectral dynamics of the attention circuits along depth (the paper's section 4.1, Fig. 2a-b).

For head h at depth point t (a time of the generator W(t), or a layer index):

    QK_h(t) = Q_h(t) K_h(t)^T,    OV_h(t) = V_h(t) O_h(t)        (embed x embed, rank <= head_size)

The nonzero eigenvalues of A B (A: n x r, B: r x n) are those of B A (r x r), so the spectra are
computed as eig(K_h^T Q_h) and eig(O_h V_h), head_size x head_size problems.

One number per circuit compares smooth and jumpy flows. Let s(t) be the real parts of every
head's eigenvalues, sorted in descending order within each head and concatenated over heads.
Over depth points t_0 < ... < t_{K-1}, the relative variation is

    V = [ 1/(K-1) sum_{k=0}^{K-2} ||s(t_{k+1}) - s(t_k)||_1 ]  /  [ 1/K sum_{k=0}^{K-1} ||s(t_k)||_1 ]

It is 0 for constant weights. For a smooth W(t) sampled at K points it shrinks like 1/K, so compare
a DiffEqFormer with a layer stack at K = the number of layers (`--num_times`).
"""

import json
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from qkvflow.analysis.circuits import AttentionCircuits, circuits_of  # noqa: E402
from qkvflow.errors import UserError  # noqa: E402
from qkvflow.integrate.weight_source import evaluation_times  # noqa: E402


def low_rank_eigenvalues(left: np.ndarray, right: np.ndarray) -> np.ndarray:
    """Nonzero spectrum of left @ right ([..., n, r] @ [..., r, n]) as eig(right @ left): [..., r] complex."""
    return np.linalg.eigvals(right @ left)


def qk_spectrum(c: AttentionCircuits) -> np.ndarray:
    """[depth, heads, head_size] eigenvalues of Q_h K_h^T."""
    return low_rank_eigenvalues(c.q, np.swapaxes(c.k, -1, -2))


def ov_spectrum(c: AttentionCircuits) -> np.ndarray:
    """[depth, heads, head_size] eigenvalues of V_h O_h."""
    return low_rank_eigenvalues(c.v, c.o)


def sorted_real(spectrum: np.ndarray) -> np.ndarray:
    """Real parts, sorted in descending order along the last axis."""
    return -np.sort(-spectrum.real, axis=-1)


def relative_variation(s: np.ndarray) -> float:
    """V of the module docstring for s [depth, ...] (already sorted); 0 when s is constant."""
    flat = s.reshape(s.shape[0], -1)
    steps = np.abs(np.diff(flat, axis=0)).sum(axis=1)
    scale = np.abs(flat).sum(axis=1).mean()
    if steps.size == 0 or not np.any(steps):
        return 0.0
    return float(steps.mean() / scale)


def plot_spectrum(depth: np.ndarray, s: np.ndarray, path: str, *, title: str, depth_label: str, marks=()) -> str:
    """One subplot per head: each sorted eigenvalue's real part against depth. s [depth, heads, r].
    `marks`: depth points drawn as dotted vertical lines (the times a fixed-grid solve evaluates W(t))."""
    heads = s.shape[1]
    cols = min(heads, 4)
    rows = -(-heads // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.2 * cols, 2.6 * rows), dpi=90, squeeze=False, sharex=True)
    colours = plt.cm.viridis(np.linspace(0, 1, s.shape[2]))
    style = "-" if depth_label == "t" else ".-"
    for h, ax in enumerate(axes.flat):
        if h >= heads:
            ax.axis("off")
            continue
        for m in range(s.shape[2]):
            ax.plot(depth, s[:, h, m], style, color=colours[m], linewidth=0.8, markersize=3)
        ax.set_title(f"head {h}", fontsize=9)
        ax.axhline(0.0, color="grey", linewidth=0.5)
        for mark in marks:
            ax.axvline(mark, color="grey", linewidth=0.6, linestyle=":")
        ax.tick_params(labelsize=7)
    for ax in axes[-1]:
        ax.set_xlabel(depth_label)
    for ax in axes[:, 0]:
        ax.set_ylabel("Re(eigenvalue)", fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def _solver_times(model) -> tuple[float, ...]:
    """The times at which a fixed-grid solve of an ODE model evaluates W(t) (where training shaped it)."""
    ode = getattr(getattr(model, "config", None), "ode", None)
    times = evaluation_times(ode) if ode is not None else None
    return () if times is None else tuple(float(t) for t in times)


def analyze_spectra(model, out_dir: str, *, num_times: int = 64, at_solver_times: bool = False) -> dict:
    """Both figures and the JSON summary (written as spectra.json and returned). With
    `at_solver_times`, an ODE model is sampled only at the times its fixed-grid solve uses."""
    marks = _solver_times(model)
    if at_solver_times and not marks:
        raise UserError(
            f"spectra: --at_solver_times needs an ODE model with a fixed-step solver, not {type(model).__name__}"
        )
    os.makedirs(out_dir, exist_ok=True)
    circuits = circuits_of(model, num_times, np.array(marks) if at_solver_times else None)
    name = type(model).__name__
    summary: dict = {"model": name, "depth": circuits.depth_label, "points": int(len(circuits.depth))}
    figures = {}
    for key, spectrum in (("qk", qk_spectrum(circuits)), ("ov", ov_spectrum(circuits))):
        s = sorted_real(spectrum)
        variation = relative_variation(s)
        summary[f"{key}_relative_variation"] = variation
        summary[f"{key}_mean_abs_real_first_last"] = [float(np.abs(s[0]).mean()), float(np.abs(s[-1]).mean())]
        label = "Q_h K_h^T" if key == "qk" else "V_h O_h"
        title = f"{name}: eigenvalues of {label} (relative variation {variation:.3g})"
        path = os.path.join(out_dir, f"spectra_{key}.png")
        figures[key] = plot_spectrum(
            circuits.depth, s, path, title=title, depth_label=circuits.depth_label, marks=marks
        )
    summary["solver_times"] = list(marks)
    summary["figures"] = figures
    summary["json"] = os.path.join(out_dir, "spectra.json")
    with open(summary["json"], "w") as f:
        json.dump(summary, f, indent=2)
    return summary
