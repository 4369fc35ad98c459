"""The end of `vitp demo`: the headline table (every seed, mean +- std, margin), all runs with seeds
aggregated, few-shot, plots, the `mlflow ui` command and the stage timings. Printing only.
"""
from __future__ import annotations

from typing import Any, Callable
from urllib.parse import urlsplit


def _duration(s: float) -> str:
    return f"{int(s) // 60}m{int(s) % 60:02d}s"


def headline(groups: list[dict[str, Any]], recipe: str, fraction: float) -> dict[str, dict[str, Any]]:
    """{source label: aggregated group} of the headline configuration."""
    return {g["source"]: g for g in groups if g["recipe"] == recipe and g["train_fraction"] == fraction}


def verdict(main: dict[str, dict[str, Any]], margin: float) -> dict[str, Any]:
    """Per-seed margins of pre-trained over scratch (seeds paired by order) and whether every one
    is at least `margin`."""
    pre, scratch = main.get("pre-trained"), main.get("scratch")
    if not pre or not scratch:
        return {"margins": [], "holds": False, "min": None}
    margins = [p - s for p, s in zip(pre["values"], scratch["values"])]
    return {"margins": margins, "holds": bool(margins) and min(margins) >= margin, "min": min(margins),
            "seeds": len(margins)}


def print_summary(result: dict[str, Any], main: tuple[str, float], margin: float, quick: bool,
                  main_cfg: Any, out: Callable[[str], None] = print) -> dict[str, Any]:
    """Print the summary block; returns the verdict (empty when the results stage failed)."""
    from vitp.tracking.seeds import format_aggregate  # lazy: mlflow

    recipe, fraction = main
    groups = result.get("groups") or []
    top = headline(groups, recipe, fraction)
    v = verdict(top, margin) if top else {}
    out("")
    out(f"== vit-pipeline demo{' --quick' if quick else ''}, seed {result['seed']} ==")
    if top:
        cfg = main_cfg
        n = max(g["n"] for g in top.values())
        out(f"{cfg.data.num_classes} fractal classes never seen in pre-training, {fraction:.0%} of their "
            f"train split; best val top-1 after {cfg.train.steps} fine-tuning steps:")
        seeds = next((g["seeds"] for g in top.values() if g["n"] == n), [])
        rows = [["source", *(f"seed {s}" for s in seeds), "mean +- std"]]
        for label in ("pre-trained", "scratch", "linear on raw pixels"):
            g = top.get(label)
            if g:
                rows.append([label, *(f"{x:.3f}" for x in g["values"]), *([""] * (n - g["n"])),
                             f"{g['mean']:.3f} +- {g['std']:.3f}" if g["n"] > 1 else "(one fit)"])
        if v.get("margins"):
            rows.append(["margin (points)", *(f"{100 * m:+.1f}" for m in v["margins"]),
                         f"min {100 * v['min']:+.1f}"])
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        for r in rows:
            out("  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
        if v.get("margins"):
            word = "beat" if v["holds"] else "did NOT beat"
            out(f"pre-training {word} training from scratch by >= {100 * margin:.0f} points in "
                f"{sum(m >= margin for m in v['margins'])}/{len(v['margins'])} seeds "
                f"(min {100 * v['min']:+.1f}, mean {100 * sum(v['margins']) / len(v['margins']):+.1f})")
    if groups:
        out("\nall runs, seeds aggregated (vitp compare --seeds):")
        out(format_aggregate(groups))
    for name, probe in (result.get("fewshot") or {}).items():
        out(f"few-shot linear probe of the pre-trained features on {name}: "
            + ", ".join(f"{k.split('/')[1].replace('shot_top1', '-shot')} {x:.3f}" for k, x in probe.items()))
    if result.get("plots"):
        out(f"\nplots:   {'  '.join(result['plots'])}  (also in MLflow, run sweep-{result['sweep_name']})")
    if result.get("tracking_uri"):
        ui = urlsplit(result["ui_url"])
        out(f"mlflow:  mlflow ui --backend-store-uri {result['tracking_uri']} --host {ui.hostname} --port {ui.port}")
        out(f"         then open {result['ui_url']}")
    out(f"time:    {_duration(result['seconds'])} ("
        + ", ".join(f"{k} {x:.0f}s" for k, x in result["timings"].items()) + ")")
    if result["failed"]:
        out("FAILED:  " + "\n         ".join(result["failed"]))
    else:
        out("status:  every stage succeeded")
    out(f"demo finished in {result['seconds']:.0f}s")
    return v


def record(result: dict[str, Any], main: tuple[str, float], quick: bool) -> dict[str, Any]:
    """What the demo measured, for <work_dir>/demo-result.json (what docs/demo.md quotes comes from
    these files): the headline per seed, every configuration's seeds aggregated, few-shot, the
    raw-pixel reference, the verdict and the stage timings."""
    recipe, fraction = main
    groups = result.get("groups") or []
    top = headline(groups, recipe, fraction)
    keep = ("recipe", "dataset", "train_fraction", "source", "seeds", "values", "mean", "std")
    return {"seed": result["seed"], "quick": quick, "main": {"recipe": recipe, "train_fraction": fraction},
            "headline": {label: {k: g[k] for k in ("seeds", "values", "mean", "std")} for label, g in top.items()},
            "verdict": result.get("verdict") or {}, "groups": [{k: g.get(k) for k in keep} for g in groups],
            "fewshot": result.get("fewshot") or {},
            "reference": [{"recipe": r, "train_fraction": f, "top1": v}
                          for (r, f), v in (result.get("reference") or {}).items()],
            "seconds": result["seconds"], "timings": result["timings"], "failed": result["failed"]}
