"""Non-finite steps on real DeepSpeed engines (spawned gloo groups, no Ray): a NaN step applies no
update for every ZeRO stage and precision; a run of them rolls back once, then stops the run."""
import math
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
import precision_workers as workers  # noqa: E402

from vitp.config import apply_overrides  # noqa: E402
from vitp.recipes import debug  # noqa: E402
from vitp.train.local import launch  # noqa: E402
from vitp.train.loop import NonFiniteGuard  # noqa: E402
from vitp.train.step import StepResult  # noqa: E402

DRILL_AT, STEPS = 5, 12


@pytest.mark.slow
@pytest.mark.parametrize("stage,precision", [(0, "fp32"), (1, "fp32"), (2, "fp32"), (3, "fp32"),
                                             (0, "bf16"), (1, "bf16"), (2, "bf16"), (3, "bf16")])
@pytest.mark.long_cases("3-bf16", "1-bf16",
                        reason="the rest of the grid; CI keeps the other stages and precisions")
def test_nan_drill_step_is_skipped(stage, precision):
    extra = [f"parallel.precision={precision}", f"train.nan_drill={DRILL_AT}", "optim.warmup_steps=4"]
    out = launch(workers.train_and_inspect, 2, stage, STEPS, extra, (DRILL_AT, DRILL_AT + 1))[0]
    # the drill step left weights, fp32 masters and optimizer state bit-identical; the next applied
    skip, after = out["changed"][DRILL_AT], out["changed"][DRILL_AT + 1]
    assert skip == [], f"ZeRO-{stage} {precision}: the NaN step changed {skip[:5]}"
    assert any(k.startswith("w") for k in after) and any(k.startswith("s") for k in after), \
        f"the step after the drill did not train: {after}"
    # the LR scheduler held on the skipped step, DeepSpeed counted it, the data position moved on
    sched = out["scheduler_steps"]
    assert sched[DRILL_AT] == sched[DRILL_AT - 1] == sched[DRILL_AT + 1] - 1 == DRILL_AT - 1
    assert out["ds_skipped"] == 1
    assert out["step"] == STEPS and out["samples_seen"] == STEPS * 8 * 2 * 2
    hist = {h["step"]: h for h in out["history"]}
    assert [hist[s]["train/skipped_steps"] for s in (DRILL_AT - 1, DRILL_AT, STEPS)] == [0, 1, 1]
    assert math.isnan(hist[DRILL_AT]["train/loss"])  # no applied step in that log window
    losses = [h["train/loss"] for h in out["history"] if h["step"] != DRILL_AT]
    assert all(math.isfinite(v) for v in losses)
    assert losses[-1] < losses[0] - 0.3, f"loss did not keep falling: {losses}"


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_persistent_nan_rolls_back_once_then_stops(tmp_path, precision):
    out = launch(workers.persistent_nan, 2, 2, precision, str(tmp_path / "ck"))[0]
    run = out["with_checkpoint"]
    # steps 4-6 skipped -> restore (weights = checkpoint of step 2; step 3 had moved them)
    assert run["restores"] == 1, run["error"]
    assert run["moved_since_checkpoint"] and run["restored_differs"] == []
    # steps 7-9 skipped again -> stop, naming step, count, restored checkpoint and causes
    err = run["error"]
    assert err and err.startswith("step 9: 3 consecutive non-finite steps")
    assert "6 skipped in all" in err and "checkpoint of step 2" in err
    for cause in ("optim.lr=", "optim.warmup_steps=", "bf16", "quarantine.parquet", "optim.grad_clip="):
        assert cause in err, f"{cause!r} missing from: {err}"
    assert run["step"] == 9  # the data position moved on; no rewind
    assert run["logged"][-1] == (8, 5, 1)  # (step, train/skipped_steps, train/rollbacks)
    bare = out["nothing_to_restore"]
    assert bare["restores"] == 1 and bare["step"] == 6
    assert bare["error"].startswith("step 6: 3 consecutive") and "no checkpoint to roll back to" in bare["error"]


@pytest.mark.slow  # spawned ranks
def test_inf_loss_on_one_rank_skips_everywhere():
    """Finite gradients, so no DeepSpeed overflow check fires: only our all-reduced flag can make
    both ranks skip. ZeRO-Offload (DeepSpeedCPUAdam) and ZeRO-3 parameter offload included."""
    combos = [(s, p, []) for p in ("fp32", "bf16") for s in (0, 1, 2, 3)]
    combos += [(2, "fp32", ["parallel.offload_optimizer=true"]),
               (3, "bf16", ["parallel.offload_optimizer=true", "parallel.offload_params=true"])]
    ranks = launch(workers.inf_loss_on_one_rank, 2, combos)
    for combo in ranks[0]:
        r0, r1 = ranks[0][combo], ranks[1][combo]
        assert math.isinf(r1["loss"]) and math.isfinite(r0["loss"]), combo
        assert r0["skipped"] and r1["skipped"], f"{combo}: ranks did not agree to skip"
        assert r0["changed"] == [] and r1["changed"] == [], f"{combo}: {r0['changed'][:3]} {r1['changed'][:3]}"
        if combo[0] < 3:  # every rank holds the full weights (ZeRO-3: only its partition)
            assert r0["checksum"] == r1["checksum"], combo
        assert not r0["next_skipped"] and not r1["next_skipped"], combo


def _step(skipped, loss):
    return StepResult(loss=loss, lr=0.1, grad_norm=float("nan"), images=8, seconds=0.0, skipped=skipped)


def test_guard_counts_streaks_and_fp16_loss_scale_overflows_are_no_streak():
    cfg = apply_overrides(debug(), ["train.nonfinite_patience=2", "parallel.precision=fp16"])
    calls = []
    guard = NonFiniteGuard(cfg, restore=lambda: calls.append(1) or 10, rank=0)
    for step in range(1, 6):  # finite loss, overflowed fp16 grads: the loss scale calibrating
        guard.after_step(step, _step(True, 2.3))
    guard.after_step(6, _step(True, float("nan")))
    guard.after_step(7, _step(False, 2.2))  # an applied step ends the streak
    guard.after_step(8, _step(True, float("nan")))
    assert calls == [] and guard.metrics() == {"train/skipped_steps": 7.0, "train/rollbacks": 0.0}
    guard.after_step(9, _step(True, float("inf")))  # 2 in a row: roll back
    assert calls == [1] and guard.metrics()["train/rollbacks"] == 1.0
    guard.after_step(10, _step(True, float("nan")))
    with pytest.raises(RuntimeError, match=r"^step 11: 2 consecutive .* checkpoint of step 10.*precision=fp16"):
        guard.after_step(11, _step(True, float("nan")))
