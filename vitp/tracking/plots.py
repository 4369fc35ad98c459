"""The `vitp compare --plot` PNG (val/top1 learning curves per dataset, best top-1 per dataset/source)
and the low-data curve (top-1 vs fraction of the train split, per source, over seeds).

Draws with matplotlib's Agg canvas (no pyplot, no display, imported only when a plot is asked for);
logs the PNG to a sweep's parent run. No torch, no ray.
"""
from __future__ import annotations

import io
import math
import os
from typing import Any, Iterable

from mlflow.exceptions import MlflowException

from vitp import storage
from vitp.tracking.compare import best_per_dataset, metric_history
from vitp.tracking.store import TrackingError, get_client

PLOT_ARTIFACT_DIR = "compare"  # where log_plot_to_parent puts the PNG inside the parent run
_MAX_PANEL_COLUMNS = 3


def figure_class():
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: F401 - Agg, headless
        from matplotlib.figure import Figure
    except ImportError as e:
        raise TrackingError(
            "plotting needs matplotlib: pip install 'vit-pipeline[demo]' (or pip install matplotlib)"
        ) from e
    return Figure


def _source_label(source: Any) -> str:
    """"scratch", or the last two parts of a checkpoint path/URI (the whole path is in the table)."""
    text = str(source or "?")
    parts = [p for p in text.rstrip("/").split("/") if p]
    return text if len(parts) <= 2 else "…/" + "/".join(parts[-2:])


def _lr_label(lr: Any) -> str:
    return "" if lr is None else f" lr={lr:g}"


def plot_compare(tracking_uri: str, rows: Iterable[dict[str, Any]], path: str | os.PathLike) -> str:
    """Write a PNG to `path` and return it: one panel of val/top1 vs step per dataset (one curve per
    run, coloured by source; the best run per dataset drawn thick with a star at its best step) and a
    grouped bar chart of best top-1 per dataset and source. Rows come from compare_rows.
    """
    Figure = figure_class()
    rows = [r for r in rows if r.get("run_id")]
    curves = {r["run_id"]: metric_history(tracking_uri, r["run_id"], "val/top1")
              for r in rows if r.get("best_top1") is not None}
    datasets = sorted({r.get("dataset") or "?" for r in rows if curves.get(r["run_id"])})
    sources = sorted({_source_label(r.get("source")) for r in rows if curves.get(r["run_id"])})
    winners = {r["run_id"] for r in best_per_dataset(rows).values()}

    n_panels = len(datasets) + 1  # + the bar chart
    ncols = min(_MAX_PANEL_COLUMNS, n_panels)
    nrows = math.ceil(n_panels / ncols)
    fig = Figure(figsize=(5.2 * ncols, 4.2 * nrows), layout="constrained")
    axes = fig.subplots(nrows, ncols, squeeze=False).ravel()
    for ax in axes[n_panels:]:
        ax.set_visible(False)
    colours = {s: f"C{i % 10}" for i, s in enumerate(sources)}

    if not datasets:
        axes[0].text(0.5, 0.5, "no val/top1 logged by the selected runs", ha="center", va="center")
        axes[0].set_axis_off()
    for ax, dataset in zip(axes, datasets):
        for r in sorted((r for r in rows if (r.get("dataset") or "?") == dataset), key=lambda r: r["run_id"]):
            points = curves.get(r["run_id"])
            if not points:
                continue
            steps, values = zip(*points)
            best = r["run_id"] in winners
            finished = r.get("status") in (None, "FINISHED")
            label = f"{_source_label(r.get('source'))}{_lr_label(r.get('lr'))}"
            label += (" (best)" if best else "") + ("" if finished else f" ({r['status']})")
            colour = colours[_source_label(r.get("source"))]
            ax.plot(steps, values, marker="o", markersize=3, color=colour, label=label,
                    linewidth=2.6 if best else 1.2, alpha=1.0 if best else 0.75,
                    linestyle="-" if finished else "--")
            if best:
                i = max(range(len(values)), key=values.__getitem__)
                ax.plot([steps[i]], [values[i]], marker="*", markersize=14, color=colour,
                        markeredgecolor="black", zorder=5)
        ax.set_title(f"{dataset}: val/top1")
        ax.set_xlabel("step")
        ax.set_ylabel("top-1")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="best")

    # Best top-1 per dataset and source: grouped bars, one group per dataset.
    ax = axes[len(datasets)] if datasets else axes[0]
    if datasets:
        width = 0.8 / max(1, len(sources))
        for j, source in enumerate(sources):
            xs, heights = [], []
            for i, dataset in enumerate(datasets):
                vals = [r["best_top1"] for r in rows if r.get("best_top1") is not None
                        and (r.get("dataset") or "?") == dataset and _source_label(r.get("source")) == source]
                if vals:
                    xs.append(i - 0.4 + width * (j + 0.5))
                    heights.append(max(vals))
            bars = ax.bar(xs, heights, width=width, color=colours[source], label=source)
            ax.bar_label(bars, fmt="%.3f", fontsize=7, padding=2)
        ax.set_xticks(range(len(datasets)), datasets)
        ax.set_ylim(0, min(1.05, max(1.0, max(r["best_top1"] for r in rows
                                               if r.get("best_top1") is not None)) * 1.1))
        ax.set_title("best val/top1 per dataset and source")
        ax.set_ylabel("best top-1")
        ax.grid(axis="y", alpha=0.3)
        # Below the axes: inside, it would cover the bars it explains.
        ax.legend(fontsize=7, title="source", title_fontsize=7, loc="upper center",
                  bbox_to_anchor=(0.5, -0.1), ncols=min(2, len(sources)))

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    storage.write_bytes(os.fspath(path), buf.getvalue())  # a path or URI, parents made
    return os.fspath(path)


def plot_low_data(groups: Iterable[dict[str, Any]], path: str | os.PathLike,
                  label=_source_label) -> str:
    """Write the low-data curve PNG to `path`: per dataset, mean best top-1 (error bar: std over
    seeds, each seed a dot) vs the fraction of its train split, one line per source (`label`
    names it). Groups come from seeds.aggregate_rows."""
    Figure = figure_class()
    groups = [g for g in groups if g.get("train_fraction") is not None]
    datasets = sorted({g.get("dataset") or "?" for g in groups})
    fig = Figure(figsize=(5.6 * max(1, len(datasets)), 4.4), layout="constrained")
    axes = fig.subplots(1, max(1, len(datasets)), squeeze=False).ravel()
    if not datasets:
        axes[0].text(0.5, 0.5, "no finished runs with a train fraction", ha="center", va="center")
        axes[0].set_axis_off()
    for ax, dataset in zip(axes, datasets):
        mine = [g for g in groups if (g.get("dataset") or "?") == dataset]
        for i, source in enumerate(sorted({label(g.get("source")) for g in mine})):
            line = sorted((g for g in mine if label(g.get("source")) == source), key=lambda g: g["train_fraction"])
            xs = [g["train_fraction"] for g in line]
            ax.errorbar(xs, [g["mean"] for g in line], yerr=[g["std"] for g in line], marker="o",
                        capsize=3, color=f"C{i}", label=source, linewidth=1.8)
            for g in line:
                ax.scatter([g["train_fraction"]] * g["n"], g["values"], s=9, color=f"C{i}", alpha=0.5)
        ax.set_xscale("log")
        ticks = sorted({g["train_fraction"] for g in mine})
        ax.set_xticks(ticks, [f"{t:.0%}" for t in ticks])
        ax.minorticks_off()
        ax.set_ylim(0, 1.02)
        ax.set_title(f"{dataset}: top-1 vs train data used")
        ax.set_xlabel("fraction of the train split (log scale)")
        ax.set_ylabel("best val top-1 (mean +- std over seeds)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="lower right")
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    storage.write_bytes(os.fspath(path), buf.getvalue())
    return os.fspath(path)


def log_plot_to_parent(tracking_uri: str, parent_run_id: str, path: str | os.PathLike) -> str:
    """Log the PNG at `path` as an artifact of the sweep parent run; returns its artifact path."""
    path = os.fspath(path)
    if not storage.isfile(path):
        raise TrackingError(f"plot {path!s} does not exist: write it with plot_compare first")
    client = get_client(tracking_uri)
    try:
        client.get_run(parent_run_id)
    except MlflowException as e:
        raise TrackingError(
            f"parent run {parent_run_id!r} not found in {client.tracking_uri}: pass the run id of the "
            "sweep's parent (the `parent` column of `vitp compare`)"
        ) from e
    with storage.local_copy(path) as local:  # MLflow uploads only local files
        client.log_artifact(parent_run_id, local, PLOT_ARTIFACT_DIR)
    return f"{PLOT_ARTIFACT_DIR}/{storage.basename(path)}"
