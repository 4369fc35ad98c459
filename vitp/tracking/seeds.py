"""`vitp compare --seeds`: runs that differ only in their seed become one row (per seed values, mean
+- sample std). Runs are grouped by what identifies a configuration in the table (dataset, source, LR,
...) and, within that, by every logged param that differs among them (a sweep's other axes). No MLflow
calls: it works on compare_rows' rows.
"""
from __future__ import annotations

import csv
import io
import json
import math
from typing import Any, Iterable

from vitp.tracking.compare import cell
from vitp.tracking.store import TrackingError

CONFIG_KEYS = ("experiment", "recipe", "variant", "dataset", "source", "lr", "train_fraction")


# Params that differ between the seeds of one configuration by construction, not a setting
PER_RUN = ("train.seed", "tracking.")


def setting_keys(runs: list[dict[str, Any]]) -> list[str]:
    """The logged params (not PER_RUN) whose values differ among `runs`: a sweep's other axes."""
    keys = sorted({k for r in runs for k in (r.get("params") or {})})
    return [k for k in keys if not k.startswith(PER_RUN)
            and len({(r.get("params") or {}).get(k) for r in runs}) > 1]


def aggregate_rows(rows: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """compare_rows rows -> one row per configuration of its FINISHED runs with a best top-1: the
    CONFIG_KEYS, "setting" (the differing params of runs that share those, e.g. "augreg=light2"; ""
    when none), n, seeds, values (best top-1 per run, in seed order), mean and std (sample std, 0 for
    one run), min and max. Sorted by dataset, fraction, mean desc."""
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for r in rows:
        if r.get("status", "FINISHED") == "FINISHED" and r.get("best_top1") is not None:
            groups.setdefault(tuple(r.get(k) for k in CONFIG_KEYS), []).append(r)
    out = []
    for key, same in groups.items():
        keys = setting_keys(same)
        by_setting: dict[tuple, list[dict[str, Any]]] = {}
        for r in same:
            by_setting.setdefault(tuple((r.get("params") or {}).get(k) for k in keys), []).append(r)
        for values_of, runs in by_setting.items():
            runs = sorted(runs, key=lambda r: (r.get("seed") is None, r.get("seed") or 0, r.get("run_name") or ""))
            values = [r["best_top1"] for r in runs]
            mean = sum(values) / len(values)
            var = sum((v - mean) ** 2 for v in values) / (len(values) - 1) if len(values) > 1 else 0.0
            setting = " ".join(f"{k.split('.')[-1]}={v}" for k, v in zip(keys, values_of))
            out.append({**dict(zip(CONFIG_KEYS, key)), "setting": setting, "n": len(values),
                        "seeds": [r.get("seed") for r in runs], "values": values, "mean": mean,
                        "std": math.sqrt(var), "min": min(values), "max": max(values)})
    return sorted(out, key=lambda a: (a.get("dataset") or "~", a.get("train_fraction") or 0.0, -a["mean"]))


def format_aggregate(groups: Iterable[dict[str, Any]], fmt: str = "text") -> str:
    """aggregate_rows as "text" (per-seed values and mean +- std), "csv" or "json"."""
    groups = list(groups)
    if fmt == "json":
        return json.dumps(groups, indent=2)
    fields = [*CONFIG_KEYS, "setting", "n", "seeds", "values", "mean", "std", "min", "max"]
    if fmt == "csv":
        buf = io.StringIO()
        writer = csv.DictWriter(buf, fieldnames=fields, lineterminator="\n")
        writer.writeheader()
        for g in groups:
            writer.writerow({k: " ".join(map(str, g[k])) if k in ("seeds", "values") else
                             ("" if g.get(k) is None else g.get(k)) for k in fields})
        return buf.getvalue()
    if fmt != "text":
        raise TrackingError(f"table format {fmt!r} is not known: use text, csv or json")
    if not groups:
        return "(no finished runs with val/top1 match: check --experiment, --sweep and --tag)"
    settings = any(g.get("setting") for g in groups)  # the column only where a sweep has other axes
    table = [["dataset", "train", "source", "lr", *(["setting"] if settings else []), "n", "per seed (best top-1)",
              "mean +- std"]]
    for g in groups:
        table.append([cell("dataset", g["dataset"]), cell("train_fraction", g["train_fraction"]),
                      cell("source", g["source"]), cell("lr", g["lr"]), *([g["setting"] or "-"] if settings else []),
                      str(g["n"]), " ".join(f"{v:.3f}" for v in g["values"]), f"{g['mean']:.3f} +- {g['std']:.3f}"])
    widths = [max(len(line[i]) for line in table) for i in range(len(table[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in table]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
