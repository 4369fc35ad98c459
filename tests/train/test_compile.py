"""`train.compile=true`: the model runs through torch.compile (DeepSpeed's engine.compile,
inductor on CPU here) and trains the same loss curve as eager. Real DeepSpeed, one gloo rank."""
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
import workers  # noqa: E402

from vitp.train.local import launch  # noqa: E402

STEPS = 10
# Measured on this CPU (pico/8, ZeRO-2, fp32): max |diff| 2.4e-7 over 10 steps; inductor fuses
# and reorders float ops, so bitwise equality is not expected.
LOSS_ATOL = 1e-5


@pytest.mark.slow
def test_compiled_model_trains_the_eager_loss_curve():
    eager = launch(workers.loss_curve, 1, STEPS)[0]
    compiled = launch(workers.loss_curve, 1, STEPS, ["train.compile=true"])[0]
    assert compiled["compiled"] and not eager["compiled"]
    assert len(eager["loss"]) == len(compiled["loss"]) == STEPS
    assert eager["loss"][-1] < eager["loss"][0] - 0.1, f"the eager run did not learn: {eager['loss']}"
    diff = max(abs(a - b) for a, b in zip(eager["loss"], compiled["loss"]))
    assert diff < LOSS_ATOL, f"compiled {compiled['loss']} vs eager {eager['loss']}"
