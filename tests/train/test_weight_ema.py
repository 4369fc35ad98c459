"""Weight EMA under ZeRO 0-3: each rank averages its own fp32 fragments, and the EMA put together from
the checkpoint's files equals ema_N = d^N w_0 + sum_k (1 - d) d^(N - k) w_k over the whole weights
after every step, on one and two ranks, and after a resume at another world size."""
import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))
import augreg_workers as workers  # noqa: E402

from vitp.train.local import launch  # noqa: E402

pytestmark = pytest.mark.slow
DECAY = 0.7  # far from 1, so every step's weight shows in the average


def formula(history, decay):
    ema = {k: v.copy() for k, v in history[0].items()}
    for w in history[1:]:
        for k in ema:
            ema[k] = decay * ema[k] + (1 - decay) * w[k]
    return ema


def check(ema, history, decay):
    want = formula(history, decay)
    assert ema.keys() == want.keys()
    moved = 0
    for k in want:
        assert np.allclose(ema[k], want[k], rtol=1e-5, atol=1e-6), (k, np.abs(ema[k] - want[k]).max())
        moved += not np.allclose(want[k], history[-1][k])
    assert moved, "the EMA must differ from the last weights somewhere"


@pytest.mark.parametrize("zero,world,precision", [(0, 1, "fp32"), (0, 2, "fp32"), (2, 1, "fp32"), (2, 2, "fp32"),
                                                  (3, 2, "fp32"), (0, 2, "bf16"), (2, 2, "bf16")])
def test_the_ema_is_the_formula_over_the_whole_weights(zero, world, precision):
    """bf16: the EMA is of the fp32 master weights (DeepSpeed's bf16 optimizer below ZeRO-1 too)."""
    results = launch(workers.ema_run, world, zero, 4, DECAY, None, None, precision)
    res = results[0]
    assert res["updates"] == 4 and len(res["history"]) == 5
    check(res["ema"], res["history"], DECAY)
    check(res["gathered"], res["history"], DECAY)  # gathered in memory, as the probes and evaluation do
    assert all(r["same"] for r in results) and all(r["gathered"] is None for r in results[1:])


@pytest.mark.parametrize("zero", [2, 3])
def test_the_ema_continues_after_a_resume_at_another_world_size(tmp_path, zero):
    first = launch(workers.ema_run, 2, zero, 3, DECAY, str(tmp_path / "ckpt"))[0]
    second = launch(workers.ema_run, 1, zero, 2, DECAY, None, str(tmp_path / "ckpt"))[0]
    assert second["updates"] == 5
    check(second["ema"], first["history"] + second["history"], DECAY)


def test_export_writes_the_ema_weights_and_refuses_a_checkpoint_without_them(tmp_path):
    from vitp.errors import InputError
    from vitp.train.export import consolidate, export, load_model

    first = launch(workers.ema_run, 2, 3, 3, DECAY, str(tmp_path / "ckpt"))[0]
    want = formula(first["history"], DECAY)
    model = load_model(export(str(tmp_path / "ckpt"), str(tmp_path / "ema-export"), "ema"))
    for name, value in model.state_dict().items():
        assert np.allclose(value.detach().numpy(), want[name], rtol=1e-5, atol=1e-6), name
    trained = consolidate(str(tmp_path / "ckpt"))  # the weights themselves: the last step's
    assert all(np.allclose(trained[k].detach().numpy(), first["history"][-1][k], atol=1e-6) for k in trained)
    launch(workers.ema_run, 1, 0, 1, DECAY, str(tmp_path / "plain"), None, "fp32", False)
    with pytest.raises(InputError, match="no weight EMA in this checkpoint"):
        consolidate(str(tmp_path / "plain"), "ema")
