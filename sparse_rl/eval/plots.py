"""Plot helpers shared by the stages: heatmaps, difference maps, line plots of a metric against
position. PNGs are written atomically (temp file, then rename).

We draw on a bare `matplotlib.figure.Figure` (Agg canvas), never through pyplot, so no global
figure state or GUI backend is involved and the helpers are safe inside long runs.
"""

from __future__ import annotations

import contextlib
import math
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

from sparse_rl.io import file_mode


@dataclass(frozen=True)
class HeatmapInfo:
    """What a heatmap drew: the array shown `[rows, cols]`, the colour scale, and where the data
    area lies in the saved PNG, in pixels with the origin at the top-left (x0, y0, x1, y1)."""

    path: Path
    data: list[list[float]]
    vmin: float
    vmax: float
    cmap: str
    axes_px: tuple[float, float, float, float]
    size_px: tuple[int, int]  # (width, height)


def _save(fig, path: str | Path) -> Path:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", suffix=".png", dir=p.parent)
    os.fchmod(fd, file_mode())  # a plot follows the umask like every other output, not mkstemp's 0600
    os.close(fd)
    try:
        fig.savefig(tmp, format="png", dpi=fig.dpi)
        os.replace(tmp, p)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    return p


def _fmt(v: float) -> str:
    return "" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.2f}"


def heatmap(matrix: Sequence[Sequence[float | None]], row_labels: Sequence, col_labels: Sequence,
            path: str | Path, *, title: str = "", xlabel: str = "", ylabel: str = "",
            vmin: float = 0.0, vmax: float = 1.0, cmap: str = "RdYlGn", annotate: bool = True,
            colorbar_label: str = "") -> HeatmapInfo:
    """Draw `matrix` `[rows, cols]` as coloured cells (row 0 on top), missing values (None/NaN) in
    grey, each cell annotated with its value; save a PNG at `path`."""
    import numpy as np
    from matplotlib import colormaps
    from matplotlib.figure import Figure

    arr = np.array([[np.nan if v is None else float(v) for v in row] for row in matrix], dtype=float)
    if arr.ndim != 2 or arr.shape != (len(row_labels), len(col_labels)):
        raise ValueError(f"heatmap: matrix shape {arr.shape} does not match labels "
                         f"({len(row_labels)} rows, {len(col_labels)} columns)")
    rows, cols = arr.shape
    fig = Figure(figsize=(max(4.0, 0.9 * cols + 2.5), max(3.0, 0.55 * rows + 1.8)), dpi=100)
    ax = fig.add_subplot()
    cm = colormaps[cmap].with_extremes(bad="#bdbdbd")
    im = ax.imshow(np.ma.masked_invalid(arr), cmap=cm, vmin=vmin, vmax=vmax, aspect="auto",
                   interpolation="nearest", origin="upper")
    ax.set_xticks(range(cols), [str(c) for c in col_labels], rotation=45 if cols > 8 else 0)
    ax.set_yticks(range(rows), [str(r) for r in row_labels])
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if title:
        ax.set_title(title, fontsize=10)
    if annotate and rows * cols <= 400:
        norm = im.norm
        for i in range(rows):
            for j in range(cols):
                if math.isnan(arr[i, j]):
                    continue
                r, g, b, _ = cm(norm(arr[i, j]))
                dark = 0.299 * r + 0.587 * g + 0.114 * b < 0.5  # white text on dark cells
                ax.text(j, i, _fmt(arr[i, j]), ha="center", va="center", fontsize=7,
                        color="white" if dark else "black")
    cbar = fig.colorbar(im, ax=ax)
    if colorbar_label:
        cbar.set_label(colorbar_label)
    fig.tight_layout()
    fig.canvas.draw()
    bbox = ax.get_window_extent()
    width, height = (int(round(v)) for v in fig.canvas.get_width_height())
    axes_px = (bbox.x0, height - bbox.y1, bbox.x1, height - bbox.y0)
    p = _save(fig, path)
    return HeatmapInfo(p, arr.tolist(), vmin, vmax, cmap, axes_px, (width, height))


def difference_map(a: Sequence[Sequence[float | None]], b: Sequence[Sequence[float | None]],
                   row_labels: Sequence, col_labels: Sequence, path: str | Path, *,
                   title: str = "", xlabel: str = "", ylabel: str = "", limit: float = 1.0,
                   name_a: str = "a", name_b: str = "b") -> HeatmapInfo:
    """Heatmap of `b - a` cell by cell on a diverging scale centred at 0 (`[-limit, limit]`),
    blue where `b` is higher; a cell missing on either side stays grey."""
    diff = [[None if (x is None or y is None or _isnan(x) or _isnan(y)) else y - x
             for x, y in zip(ra, rb)] for ra, rb in zip(a, b)]
    return heatmap(diff, row_labels, col_labels, path, title=title or f"{name_b} - {name_a}",
                   xlabel=xlabel, ylabel=ylabel, vmin=-limit, vmax=limit, cmap="RdBu",
                   colorbar_label=f"{name_b} - {name_a}")


def _isnan(v) -> bool:
    return isinstance(v, float) and math.isnan(v)


def line_plot(x: Sequence[float], series: Mapping[str, Sequence[float]], path: str | Path, *,
              title: str = "", xlabel: str = "position", ylabel: str = "", logx: bool = False,
              logy: bool = False) -> Path:
    """One line per entry of `series` (each as long as `x`), e.g. a metric against token position."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.0, 3.8), dpi=100)
    ax = fig.add_subplot()
    for name, ys in series.items():
        if len(ys) != len(x):
            raise ValueError(f"line_plot: series '{name}' has {len(ys)} points for {len(x)} x values")
        ax.plot(list(x), list(ys), marker="o", markersize=3, label=name)
    if logx:
        ax.set_xscale("log", base=2)
    if logy:
        ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if title:
        ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    if len(series) > 1:
        ax.legend(fontsize=8)
    fig.tight_layout()
    return _save(fig, path)
