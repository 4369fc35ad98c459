"""bf16 and ZeRO-Offload on CPU through real DeepSpeed engines (spawned gloo groups, no Ray):
they learn, keep bf16 weights over fp32 masters, step DeepSpeedCPUAdam, and resume exactly.

The offload tests load DeepSpeed's cpu_adam op, which `make install` built into the venv's
torch-extensions folder (a test run without it builds it there first, ~35 s on 2 cores)."""
import math
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
import precision_workers as workers  # noqa: E402

from vitp.model import memory  # noqa: E402
from vitp.train import checkpoint as ckpt  # noqa: E402
from vitp.train.local import launch  # noqa: E402

STEPS = 20


def _learned(out, what):
    losses = [h["train/loss"] for h in out["history"]]
    assert len(losses) == STEPS and all(math.isfinite(v) for v in losses), f"{what}: {losses}"
    assert losses[-1] < losses[0] - 0.3, f"{what}: loss did not fall: {losses}"
    assert out["history"][-1]["train/skipped_steps"] == 0, f"{what}: steps were skipped"


@pytest.mark.long_cases("3", reason="the rest of the grid; CI keeps [1] and [2]")
@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_bf16_on_cpu_learns_over_fp32_masters(stage):
    out = launch(workers.train_and_inspect, 2, stage, STEPS, ["parallel.precision=bf16"])[0]
    _learned(out, f"bf16 ZeRO-{stage}")
    assert out["param_dtypes"] == ["torch.bfloat16"]  # the module computes in bf16
    assert out["master_dtypes"] == ["torch.float32"]  # what the optimizer steps
    assert out["state_dtypes"] == ["torch.float32"], out["state_dtypes"]  # Adam moments
    if stage == 1:  # DeepSpeed's flat BF16 optimizer (memory.flat_bf16_optimizer), as modelled
        assert out["wrapper"] == "BF16_Optimizer", out["wrapper"]
        # between steps it holds all the memory model counts but backward's bf16 gradients (2P)
        P = out["params"]
        assert out["held_bytes"] == pytest.approx(memory.states_bytes(P, 1, 2, "bf16") - 2 * P, rel=0.01)


@pytest.mark.long_cases("3-bf16", reason="the rest of the grid; CI keeps [2-fp32]")
@pytest.mark.slow
@pytest.mark.parametrize("stage,precision", [(2, "fp32"), (3, "bf16")])
def test_zero_offload_optimizer_learns_with_cpu_adam(stage, precision):
    extra = [f"parallel.precision={precision}", "parallel.offload_optimizer=true"]
    out = launch(workers.train_and_inspect, 2, stage, STEPS, extra)[0]
    _learned(out, f"ZeRO-{stage} offload {precision}")
    assert out["optimizer"] == "DeepSpeedCPUAdam"
    assert out["offload"] == (True, False)  # the ZeRO wrapper keeps masters + state off the device
    assert out["state_devices"] == ["cpu"]
    assert out["master_dtypes"] == out["state_dtypes"] == ["torch.float32"]


@pytest.mark.slow
def test_zero3_parameter_offload_learns():
    extra = ["parallel.offload_params=true", "parallel.offload_optimizer=true"]
    out = launch(workers.train_and_inspect, 2, 3, STEPS, extra)[0]
    _learned(out, "ZeRO-3 parameter offload")
    assert out["offload"] == (True, True)


@pytest.mark.slow
def test_offload_checkpoint_resume_continues_exactly(tmp_path):
    extra = ["parallel.offload_optimizer=true"]
    out = launch(workers.resume_with, 2, 2, 8, 4, str(tmp_path / "ck"), extra)[0]
    assert out["optimizer"] == "DeepSpeedCPUAdam" and out["step"] == 4
    assert len(out["full"]) == 8 and len(out["resumed"]) == 4
    for a, b in zip(out["full"][4:], out["resumed"]):
        assert abs(a - b) < 1e-5, f"resumed {out['resumed']} != uninterrupted {out['full'][4:]}"
    assert ckpt.verify(str(tmp_path / "ck"))[0]
