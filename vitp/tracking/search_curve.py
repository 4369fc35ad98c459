"""A sweep's search efficiency for `vitp compare --sweep`: per dataset, the best top-1 found so far
against trials used (in the order trials ended) and wall time since the sweep's first trial started,
the best trial's swept values, and a PNG of both curves. No torch, no ray."""
from __future__ import annotations

import io
import json
import os
from typing import Any, Iterable
from urllib.parse import quote, urlsplit

from vitp.console import duration
from vitp.tracking.compare import best_per_dataset
from vitp.tracking.store import get_client

AXES = ("recipe", "source")  # a sweep's trial keys that are not config params (vitp.tune.spec.AXES)


def best_so_far(rows: Iterable[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """{dataset: one point per ended trial, in the order they ended: trials (used so far), wall_s
    (since the first trial of the rows started), value (its best top-1; None unless FINISHED, the
    rule the sweep's best trial follows), best (the best value so far, or None), run_name}."""
    rows = [r for r in rows if r.get("end_time") and r.get("start_time")]
    if not rows:
        return {}
    t0 = min(r["start_time"] for r in rows)
    out: dict[str, list[dict[str, Any]]] = {}
    for r in sorted(rows, key=lambda r: (r["end_time"], r.get("run_name") or "")):
        points = out.setdefault(r.get("dataset") or "?", [])
        value = r.get("best_top1") if r.get("status") == "FINISHED" else None
        best = points[-1]["best"] if points else None
        if value is not None and (best is None or value > best):
            best = value
        points.append({"trials": len(points) + 1, "wall_s": (r["end_time"] - t0) / 1000.0, "value": value,
                       "best": best, "run_name": r.get("run_name")})
    return out


def swept_keys(tracking_uri: str, parent_run_ids: Iterable[str]) -> list[str]:
    """The config keys the sweeps' parents record as searched (param sweep.space), sorted."""
    client, keys = get_client(tracking_uri), set()
    for run_id in parent_run_ids:
        space = client.get_run(run_id).data.params.get("sweep.space")
        try:
            keys.update(k for k in json.loads(space or "{}") if k not in AXES)
        except ValueError:  # a parent written by hand, or cut at MLflow's param length
            continue
    return sorted(keys)


def summary_lines(rows: list[dict[str, Any]], keys: list[str]) -> list[str]:
    """What `vitp compare --sweep` prints under its table: per dataset, the best-so-far curve and
    the best trial with its swept values."""
    lines = []
    best = best_per_dataset(rows)
    for dataset, points in sorted(best_so_far(rows).items()):
        curve = ", ".join(f"{p['best']:.4f}" if p["best"] is not None else "-" for p in points)
        lines.append(f"best so far on {dataset}, after each of {len(points)} trial(s): {curve}")
        row = best.get(dataset)
        if row is None:
            continue
        found = next(p for p in points if p["best"] == row["best_top1"])
        values = ", ".join(f"{k}={row['params'][k]}" for k in keys if k in (row.get("params") or {}))
        lines.append(f"best configuration on {dataset}: {row['run_name']} top-1 {row['best_top1']:.4f}"
                     f"{': ' + values if values else ''} (trial {found['trials']} of {len(points)}, "
                     f"{duration(found['wall_s'])} into the sweep)")
    return lines


def compare_url(tracking_uri: str, rows: list[dict[str, Any]]) -> str | None:
    """The MLflow page that shows a sweep's trials side by side, with a parallel-coordinates plot of
    the params they differ in (MLflow draws the first three of those and the first metric; pick the
    sweep's metric there): on a tracking server, None for a local store (or no trials)."""
    parts = urlsplit(tracking_uri)
    trials = [r for r in rows if r.get("parent")]
    if parts.scheme not in ("http", "https") or not trials:
        return None
    base = f"{parts.scheme}://{parts.hostname}{f':{parts.port}' if parts.port else ''}{parts.path.rstrip('/')}"
    runs = json.dumps([r["run_id"] for r in trials])
    experiments = json.dumps(sorted({r["experiment_id"] for r in trials}))
    return f"{base}/#/compare-runs?runs={quote(runs)}&experiments={quote(experiments)}"


def search_plot_path(plot: str) -> str:
    """Where `--plot compare.png` puts the search curves: compare-search.png beside it."""
    stem, ext = os.path.splitext(plot)
    return f"{stem}-search{ext or '.png'}"


def plot_search(rows: list[dict[str, Any]], path: str | os.PathLike) -> str:
    """Write a PNG of the best top-1 so far against trials used and against wall time (minutes),
    one step line per dataset, each trial's own top-1 as a dot; returns the path."""
    from vitp import storage
    from vitp.tracking.plots import figure_class

    Figure = figure_class()
    from matplotlib.ticker import MaxNLocator

    curves = best_so_far(rows)
    fig = Figure(figsize=(11, 4.2), dpi=100)
    for i, (x_key, label) in enumerate((("trials", "trials used"), ("wall_s", "wall time (min)"))):
        ax = fig.add_subplot(1, 2, i + 1)
        for dataset, points in sorted(curves.items()):
            xs = [p[x_key] / (60.0 if x_key == "wall_s" else 1.0) for p in points]
            line = ax.step(xs, [p["best"] if p["best"] is not None else float("nan") for p in points],
                           where="post", label=f"{dataset}: best so far")[0]
            ax.plot([x for x, p in zip(xs, points) if p["value"] is not None],
                    [p["value"] for p in points if p["value"] is not None], "o", ms=4, alpha=0.5,
                    color=line.get_color())
        if x_key == "trials":
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel(label)
        ax.set_ylabel("best top-1 so far")
        ax.grid(alpha=0.3)
        if curves:
            ax.legend(fontsize=8, loc="lower right")
    fig.suptitle("search efficiency: best val/top1 found so far (dots: each trial's)")
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    storage.write_bytes(os.fspath(path), buf.getvalue())  # a path or URI, parents made
    return os.fspath(path)
