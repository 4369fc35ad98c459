"""After training, its own step: pictures of the trained model added to its ended MLflow run. A
fine-tuned model gets attention rollouts of a few held-out images (the paper's Figure 6 view), a
pre-trained one that reached train.steps the Figure 7 report (`vitp analyze`'s files under
`analysis/`, its numbers as `analysis/*` metrics). Best effort: a failure is a warning, the run
stays as training ended it. Reads a few rows of one shard directly: no Ray.
"""
from __future__ import annotations

import tempfile
from typing import TYPE_CHECKING

import torch

from .. import storage
from ..config import Run
from ..console import get_logger
from ..data.ingest import normalize, peek_rows
from ..model.analysis import REPORT, summary_lines, write_report
from ..model.attention import write_rollout_pngs
from ..model.vit import build_vit
from ..tracking.runs import RunLogger
from .export import consolidate

if TYPE_CHECKING:
    from .trainer import TrainSummary

log = get_logger(__name__)

IMAGES = 4  # held-out images each picture is drawn from


def log_report(run: Run, summary: "TrainSummary") -> None:
    """The pictures of the model `run` trained (`summary`, run_training's) in its MLflow run; nothing
    for an untracked run, one that trained nothing now (already finished), or a paused pre-training."""
    if not (summary.mlflow_run_id and summary.checkpoint) or summary.already_finished:
        return
    cfg = run.cfg
    if cfg.model.head == "finetune":
        what, write = "attention rollouts", _rollouts
    elif summary.metrics.get("step", 0) >= cfg.train.steps:
        what, write = "Figure 7 analysis", _analysis
    else:
        return
    try:
        logger = RunLogger.existing(run.tracking_uri, summary.mlflow_run_id)
        model = build_vit(cfg.model, cfg.data.image_size, mpp=cfg.train.objective == "mpp")
        model.load_state_dict(consolidate(summary.checkpoint))
        write(run, logger, model, peek_rows(run, ("val", "train"), IMAGES), int(summary.metrics.get("step", 0)))
    except Exception as e:  # the run itself succeeded; say why the pictures are missing
        log.warning("[%s] %s not logged: %s", run.name, what, e)


def _rollouts(run: Run, logger: RunLogger, model, rows: dict, step: int) -> None:
    with tempfile.TemporaryDirectory() as d:
        for path in write_rollout_pngs(model, rows["image"], rows["label"].tolist(), d, originals=rows["stored"]):
            logger.log_artifact(path, "attention")


def _analysis(run: Run, logger: RunLogger, model, rows: dict, step: int) -> None:
    images = normalize(torch.from_numpy(rows["image"])).contiguous()  # (n, 3, S, S)
    with tempfile.TemporaryDirectory() as d:
        report = write_report(model, d, images)
        for name in (*report["files"], REPORT):
            logger.log_artifact(storage.join(d, name), "analysis")
    pos = report["pos_embed"]
    logger.log_metrics({f"analysis/pos_embed_{k}": v for k, v in (
        ("distance_corr", pos["distance_corr"]), ("neighbour_sim", pos["neighbour_similarity"]),
        ("other_sim", pos["other_similarity"])) if v is not None}, step)
    for line in summary_lines(report):
        log.info("[%s] %s", run.name, line)
