"""Do tokens cluster under attention with time-dependent weights? (the paper's appendix C.8, after
Geshkovski et al., "A mathematical perspective on Transformers", 2023).

n = 40 tokens on the unit sphere S^2 (the layer-norm view: x_i(0) = u_i / |u_i|, u_i ~ U[-2, 2]^3),
one head with Q(t) = K(t) = A0 f(t), V(t) = V0 f(t), A0 = V0 = I:

    dx_i/dt = P_{x_i}( sum_j softmax_j(<Q(t) x_i, K(t) x_j>) V(t) x_j ),     P_x v = v - <v, x> x

(no 1/sqrt(d) in the scores), Euler steps dt = 0.1 to T = 20, each followed by renormalisation onto
the sphere. The weight scalings are f_k(t) = (1 + t)^{p_k}, p = (0, 1, 1.5, 2, 2.5, 3): f0 constant
(shared weights), f1 linear, f2..f5 faster than linear.

Why A0 = V0 = I: it is the case in which Geshkovski et al. prove that constant weights gather all
tokens into one cluster (d >= 3), and it keeps f the only variable; random matrices add structure
(a V with negative eigenvalues repels) whose effect depends on the draw. The attention's inverse
temperature is f(t)^2: when it grows fast, each token attends almost only to itself
(<x_i, x_i> = 1 is the largest score on the sphere), its velocity P_x(x) vanishes and the tokens
freeze before they can gather.

Measures of the final positions (already unit vectors):

    dispersion = mean_{i != j} |x_i - x_j|        (4/3 for uniform points on S^2, 0 for one cluster)
    clusters   = number of connected components of the graph joining tokens closer than r = 0.05
"""

import json
import os
from typing import Callable

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

EXPONENTS = {"f0": 0.0, "f1": 1.0, "f2": 1.5, "f3": 2.0, "f4": 2.5, "f5": 3.0}
RADIUS = 0.05


def scaling(p: float) -> Callable[[float], float]:
    """f(t) = (1 + t)^p."""
    return lambda t: (1.0 + t) ** p


def initial_positions(n: int = 40, seed: int = 0) -> np.ndarray:
    u = np.random.default_rng(seed).uniform(-2.0, 2.0, size=(n, 3))
    return u / np.linalg.norm(u, axis=1, keepdims=True)


def velocity(x: np.ndarray, s: float, A0: np.ndarray, V0: np.ndarray) -> np.ndarray:
    """dx/dt of every token for weights Q = K = s A0, V = s V0, projected onto the sphere's tangent spaces."""
    q, k, v = x @ (s * A0).T, x @ (s * A0).T, x @ (s * V0).T
    scores = q @ k.T
    p = np.exp(scores - scores.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    dx = p @ v
    return dx - np.sum(dx * x, axis=1, keepdims=True) * x


def simulate(f: Callable[[float], float], x0: np.ndarray, *, T: float = 20.0, dt: float = 0.1, A0=None, V0=None):
    """[steps + 1, n, 3] Euler trajectory on the sphere (A0, V0: identity unless given)."""
    A0 = np.eye(x0.shape[1]) if A0 is None else A0
    V0 = np.eye(x0.shape[1]) if V0 is None else V0
    xs = [x0]
    for k in range(int(round(T / dt))):
        x = xs[-1] + dt * velocity(xs[-1], f(k * dt), A0, V0)
        xs.append(x / np.linalg.norm(x, axis=1, keepdims=True))
    return np.stack(xs)


def _distances(x: np.ndarray) -> np.ndarray:
    return np.linalg.norm(x[:, None, :] - x[None, :, :], axis=-1)


def dispersion(x: np.ndarray) -> float:
    n = x.shape[0]
    return float(_distances(x).sum() / (n * (n - 1)))


def count_clusters(x: np.ndarray, radius: float = RADIUS) -> int:
    """Connected components of the graph with an edge between tokens closer than `radius`."""
    linked = _distances(x) < radius
    label = np.arange(x.shape[0])
    while True:  # propagate the smallest label along edges until nothing changes
        new = np.where(linked, label[None, :], label.size).min(axis=1)
        if np.array_equal(new, label):
            return int(np.unique(label).size)
        label = new


def plot_trajectories(trajectories: dict[str, np.ndarray], path: str, *, title: str) -> str:
    fig = plt.figure(figsize=(12, 7.6), dpi=80)
    for i, (name, xs) in enumerate(trajectories.items()):
        ax = fig.add_subplot(2, 3, i + 1, projection="3d")
        for token in range(xs.shape[1]):
            ax.plot(*xs[:, token].T, color="tab:blue", linewidth=0.6, alpha=0.5)
        ax.scatter(*xs[0].T, color="grey", s=6)
        ax.scatter(*xs[-1].T, color="tab:red", s=14)
        ax.set_title(f"{name}: f(t) = (1+t)^{EXPONENTS[name]:g}", fontsize=10)
        ax.set_xlim(-1, 1), ax.set_ylim(-1, 1), ax.set_zlim(-1, 1)
        ax.set_box_aspect((1, 1, 1))
        ax.set_xticklabels([]), ax.set_yticklabels([]), ax.set_zticklabels([])
    fig.suptitle(title, fontsize=11)
    fig.subplots_adjust(left=0.02, right=0.98, bottom=0.02, top=0.9, wspace=0.05, hspace=0.1)
    fig.savefig(path)
    plt.close(fig)
    return path


def analyze_clusters(out_dir: str, *, seed: int = 0, n: int = 40, T: float = 20.0, dt: float = 0.1) -> dict:
    """Simulate every f_k from the same initial tokens; figure and JSON summary (clusters.json)."""
    os.makedirs(out_dir, exist_ok=True)
    x0 = initial_positions(n, seed)
    trajectories = {name: simulate(scaling(p), x0, T=T, dt=dt) for name, p in EXPONENTS.items()}
    summary: dict = {"seed": seed, "tokens": n, "T": T, "dt": dt, "radius": RADIUS}
    summary.update(initial_dispersion=dispersion(x0), initial_clusters=count_clusters(x0))
    summary["runs"] = {
        name: {"f": f"(1+t)^{p:g}", "dispersion": dispersion(xs[-1]), "clusters": count_clusters(xs[-1])}
        for (name, xs), p in zip(trajectories.items(), EXPONENTS.values())
    }
    title = f"{n} tokens on S^2, Q = K = V = f(t) I, T = {T:g} (grey: start, red: end)"
    summary["figure"] = plot_trajectories(trajectories, os.path.join(out_dir, "clusters.png"), title=title)
    summary["json"] = os.path.join(out_dir, "clusters.json")
    with open(summary["json"], "w") as f:
        json.dump(summary, f, indent=2)
    return summary
