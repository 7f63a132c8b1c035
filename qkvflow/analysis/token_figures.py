"""Figures of token sensitivity (the paper's Fig. 3) and of attention maps along depth (appendix F).

Tokens are coloured by their Lyapunov exponent for the target token on a sequential colour map
from the smallest to the largest exponent of the text; the target is outlined.
"""

import html

import matplotlib

matplotlib.use("Agg")
import matplotlib.colors as mcolors  # noqa: E402
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

CMAP = "YlOrRd"
DARK = 0.65  # above this point of the colour map, text is drawn in white


def display(token: str) -> str:
    """A token as one printable cell: newlines and tabs shown, not applied (and `$` never starts
    math: figures draw text with parse_math=False)."""
    return token.replace("\n", "\u21b5").replace("\t", "\u21e5")


def _colours(values: np.ndarray):
    norm = mcolors.Normalize(vmin=float(np.min(values)), vmax=float(np.max(values)) + 1e-12)
    return plt.get_cmap(CMAP), norm


def write_html(tokens: list[str], values: np.ndarray, target: int, path: str, *, title: str) -> str:
    cmap, norm = _colours(values)
    cells = []
    for i, (token, value) in enumerate(zip(tokens, values)):
        shade = norm(value)
        colour = mcolors.to_hex(cmap(shade))
        ink = "color:white;" if shade > DARK else ""
        outline = "outline:2px solid #1f4e9a;" if i == target else ""
        cells.append(
            f'<span style="background:{colour};{ink}{outline}" title="token {i}: lambda = {value:.4f}">'
            f"{html.escape(display(token))}</span>"
        )
    page = f"""<!doctype html>
<html><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>body{{font-family:sans-serif;max-width:60em;margin:2em auto}}
.text{{font-family:monospace;font-size:1.1em;line-height:2.2em;white-space:pre-wrap}}
.text span{{padding:0.2em 0;border-radius:2px}}</style></head>
<body><h2>{html.escape(title)}</h2>
<p>Each input token coloured by its largest Lyapunov exponent for the outlined last token
(from {values.min():.3g}, light, to {values.max():.3g}, dark). Hover for the value.</p>
<div class="text">{"".join(cells)}</div></body></html>
"""
    with open(path, "w", encoding="utf-8") as f:
        f.write(page)
    return path


def plot_tokens(tokens: list[str], values: np.ndarray, target: int, path: str, *, title: str) -> str:
    """Tokens laid out as monospace text, wrapped to the figure's width, each cell on its colour."""
    cmap, norm = _colours(values)
    fontsize, text_width_in = 11, 8.4
    width = int(text_width_in * 72 / (0.602 * fontsize))  # characters per line; DejaVu Sans Mono: 0.602 em
    lines, line, used = [], [], 0
    for i, token in enumerate(tokens):
        cell = display(token)
        if line and used + len(cell) > width:
            lines.append(line)
            line, used = [], 0
        line.append((i, cell, used))
        used += len(cell)
    lines.append(line)
    height = 0.3 * len(lines)
    fig = plt.figure(figsize=(10, height + 0.8), dpi=100)
    ax = fig.add_axes([0.02, 0.1 / (height + 0.8), text_width_in / 10, height / (height + 0.8)])
    ax.set_xlim(0, width)
    ax.set_ylim(len(lines), 0)
    ax.axis("off")
    for row, cells in enumerate(lines):
        for i, cell, column in cells:
            edge = "#1f4e9a" if i == target else "none"
            shade = norm(values[i])
            box = dict(facecolor=cmap(shade), edgecolor=edge, boxstyle="square,pad=0.1")
            colour = "white" if shade > DARK else "black"
            font = dict(family="DejaVu Sans Mono", fontsize=fontsize, color=colour, parse_math=False)
            ax.text(column, row + 0.5, cell, va="center", bbox=box, **font)
    bar = fig.add_axes([0.9, 0.15, 0.015, 0.6])
    fig.colorbar(plt.cm.ScalarMappable(norm=norm, cmap=cmap), cax=bar).set_label("lambda", fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.savefig(path)
    plt.close(fig)
    return path


def plot_attention_maps(maps: np.ndarray, times: np.ndarray, tokens: list[str], path: str, *, title: str) -> str:
    """maps [times, heads, n, n]: a row per time, a column per head; rows query, columns key."""
    rows, heads, n = maps.shape[0], maps.shape[1], maps.shape[2]
    fig, axes = plt.subplots(rows, heads, figsize=(2.4 * heads, 2.4 * rows + 0.6), dpi=90, squeeze=False)
    fig.subplots_adjust(left=0.08, right=0.98, bottom=0.1, top=0.9, wspace=0.35, hspace=0.45)
    labels = n <= 24
    for r in range(rows):
        for h in range(heads):
            ax = axes[r, h]
            ax.imshow(maps[r, h], cmap="Blues", vmin=0.0, vmax=1.0)
            ax.set_xticks(range(n) if labels else [])
            ax.set_yticks(range(n) if labels else [])
            if labels:
                ax.set_xticklabels([display(t) for t in tokens], rotation=90, fontsize=5, parse_math=False)
                ax.set_yticklabels([display(t) for t in tokens], fontsize=5, parse_math=False)
            if r == 0:
                ax.set_title(f"head {h}", fontsize=9)
            if h == 0:
                ax.set_ylabel(f"t = {times[r]:.3g}", fontsize=9)
    fig.suptitle(title, fontsize=10)
    fig.savefig(path)
    plt.close(fig)
    return path
