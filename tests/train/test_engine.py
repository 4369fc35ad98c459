"""The DeepSpeed engine without Ray: config generation, ZeRO equivalence, resume, export.

Multi-rank tests spawn 2 local processes joined by gloo (vitp.train.local.launch).
"""
import math
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
import workers  # noqa: E402

from vitp import storage  # noqa: E402
from vitp.config import apply_overrides  # noqa: E402
from vitp.model.vit import ViT  # noqa: E402
from vitp.recipes import debug, get_recipe  # noqa: E402
from vitp.train import checkpoint as ckpt  # noqa: E402
from vitp.train import restore  # noqa: E402
from vitp.train.engine import build_ds_config, lr_multiplier, param_groups  # noqa: E402
from vitp.train.local import launch  # noqa: E402
from vitp.config import Run


def test_ds_config_from_config():
    cfg = apply_overrides(get_recipe("h14_i21k"), ["parallel.zero_stage=3", "parallel.offload_params=true",
                                                   "parallel.offload_optimizer=true"])
    ds = build_ds_config(cfg)
    assert ds["train_batch_size"] == 4096 == ds["train_micro_batch_size_per_gpu"] * ds["gradient_accumulation_steps"] * 32
    assert ds["zero_optimization"]["stage"] == 3
    assert ds["zero_optimization"]["offload_param"]["device"] == "cpu"
    assert ds["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert ds["bf16"]["enabled"] and not ds["fp16"]["enabled"]
    assert ds["gradient_clipping"] == 1.0
    fp16 = build_ds_config(apply_overrides(debug(), ["parallel.precision=fp16"]))
    assert fp16["fp16"]["enabled"] and not fp16["bf16"]["enabled"]


def test_ds_config_checks_running_world():
    with pytest.raises(ValueError, match=r"global batch 32 != micro 16 x accum 1 x world 4 = 64.*num_workers=4"):
        build_ds_config(debug(), world_size=4)


def test_lr_schedule_warmup_then_decay():
    cfg = apply_overrides(debug(), ["optim.warmup_steps=10", "train.steps=110", "optim.schedule=linear"])
    o, T = cfg.optim, cfg.train.steps
    assert lr_multiplier(0, o, T) == pytest.approx(0.1)
    assert lr_multiplier(9, o, T) == pytest.approx(1.0)
    assert lr_multiplier(60, o, T) == pytest.approx(0.5)
    assert lr_multiplier(110, o, T) == pytest.approx(0.0)
    cos = apply_overrides(cfg, ["optim.schedule=cosine", "optim.min_lr_ratio=0.1"]).optim
    assert lr_multiplier(60, cos, T) == pytest.approx(0.1 + 0.9 * 0.5)
    assert lr_multiplier(110, cos, T) == pytest.approx(0.1)


def test_no_decay_on_biases_norms_posembed_cls():
    model = ViT("pico/8", image_size=32, num_classes=10)
    decay, no_decay = param_groups(model, 0.1)
    names = {id(p): n for n, p in model.named_parameters()}
    nd = {names[id(p)] for p in no_decay["params"]}
    d = {names[id(p)] for p in decay["params"]}
    assert {"pos_embed", "cls_token", "norm.weight", "blocks.0.mlp.fc1.bias"} <= nd
    assert all(n.endswith("weight") and "norm" not in n for n in d)
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert len(d) + len(nd) == len(list(model.parameters()))


@pytest.mark.slow
def test_zero_stages_match_stage0_and_learn():
    """Same seed, same data, 2 ranks: ZeRO-1/2/3 reproduce stage 0's loss curve."""
    steps = 12
    curves = launch(workers.curves_per_stage, 2, [0, 1, 2, 3], steps)[0]
    base = curves[0]
    assert len(base) == steps and all(math.isfinite(v) for v in base)
    assert base[-1] < base[0] - 0.3, f"loss did not fall: {base}"
    for stage in (1, 2, 3):
        diff = max(abs(a - b) for a, b in zip(base, curves[stage]))
        assert diff < 1e-4, f"ZeRO-{stage} deviates from stage 0 by {diff}: {curves[stage]} vs {base}"
        gn = max(abs(a - b) for a, b in zip(curves["0/grad_norm"], curves[f"{stage}/grad_norm"]))
        assert gn < 1e-3, f"ZeRO-{stage} grad norm deviates by {gn}"


# Every ZeRO stage; world 1 with two micro-batches a step too. The Ray contract of a resume (a
# killed Train worker restarted at the data position) is test_pretrain_ray's, once, at ZeRO-3.
@pytest.mark.long_cases("2-0", reason="the rest of the grid; CI keeps [2-3], [2-1], [1-2]")
@pytest.mark.slow
@pytest.mark.parametrize("world,stage", [(2, 0), (2, 1), (1, 2), (2, 3)])
def test_checkpoint_resume_continues_exactly(tmp_path, world, stage):
    out = launch(workers.resume_run, world, stage, 8, 4, str(tmp_path / "ck"))[0]
    assert out["step"] == 4
    assert len(out["resumed"]) == len(out["full"]) == 8
    # bitwise: both curves run the same kernels on the same data, the resumed one from the saved state
    assert out["resumed"] == out["full"], f"resumed curve {out['resumed']} != uninterrupted {out['full']}"
    ok, _ = ckpt.verify(str(tmp_path / "ck"))
    assert ok
    # the chaos soak's own completeness read (benchmarks/soak_checks.py) knows DeepSpeed's layout
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
    from soak_checks import independently_complete

    assert independently_complete(str(tmp_path / "ck")) == (True, f"ZeRO-{stage}, {world} rank(s): complete")


@pytest.mark.slow
@pytest.mark.parametrize("stage", [0, 2, 3])
def test_export_gives_engine_logits(tmp_path, stage):
    from vitp.train.export import load_model

    ck, ex = str(tmp_path / "ck"), str(tmp_path / "export")
    logits = torch.from_numpy(launch(workers.train_save_export, 2, stage, 4, ck, ex)[0])
    model = load_model(ex)  # plain vitp.model, no DeepSpeed
    probe = torch.Generator().manual_seed(123)
    x = torch.randn(4, 3, 32, 32, generator=probe)
    with torch.no_grad():
        ours = model(x)
    assert not torch.allclose(logits, torch.zeros_like(logits))  # trained: head is no longer zero
    torch.testing.assert_close(ours, logits, atol=1e-5, rtol=1e-4)


def test_incomplete_checkpoint_is_refused(tmp_path):
    d = tmp_path / "ck"
    (d / "complete").mkdir(parents=True)
    assert not ckpt.verify(str(d))[0]
    (d / "meta.json").write_text('{"world_size": 2, "step": 3, "tag": "state", "train_state": {}}')
    (d / "complete" / "rank_00000.json").write_text('{"files": {}}')
    ok, reason = ckpt.verify(str(d))
    assert not ok and "rank 1 of 2 has no completion marker" in reason
    (d / "complete" / "rank_00001.json").write_text('{"files": {"state/x.pt": 10}}')
    ok, reason = ckpt.verify(str(d))
    assert not ok and "state/x.pt from rank 1 is missing or truncated" in reason
    (d / "state").mkdir()
    (d / "state" / "x.pt").write_bytes(b"0" * 10)
    assert ckpt.verify(str(d)) == (True, "complete")
    # storage copies files in place: a half-copied marker or meta reads as incomplete, not a crash
    (d / "complete" / "rank_00001.json").write_text('{"files": {"state/x.pt"')
    ok, reason = ckpt.verify(str(d))
    assert not ok and "marker of rank 1 is unreadable" in reason
    (d / "meta.json").write_text('{"world_si')
    ok, reason = ckpt.verify(str(d))
    assert not ok and "meta.json is unreadable" in reason
    with pytest.raises(RuntimeError, match="refusing to restore"):
        restore.load(None, str(tmp_path / "nothing"))


def test_the_newest_complete_checkpoint_is_picked_and_each_newer_one_passed_over_is_named(tmp_path):
    from vitp.recipes import resolve

    cfg = resolve("debug", [f"work_dir={tmp_path}", "tracking.run_name=r"])
    for step, complete in [(2, True), (4, False), (6, False)]:
        d = tmp_path / "runs" / "r" / f"checkpoint_{step:08d}"
        (d / "complete").mkdir(parents=True)
        (d / "meta.json").write_text(f'{{"world_size": 1, "step": {step}, "tag": "state", "train_state": {{}}}}')
        if complete:
            (d / "complete" / "rank_00000.json").write_text('{"files": {}}')
    # Ray Train's own bookkeeping beside them is no checkpoint, and not worth a warning
    (tmp_path / "runs" / "r" / "checkpoint_manager_snapshot.json").write_text("{}")
    warned = []
    got = ckpt.latest_complete_checkpoint(Run.of(cfg), warn=warned.append)
    assert got == str(tmp_path / "runs" / "r" / "checkpoint_00000002")
    assert [w.split(":")[0] for w in warned] == [
        f"passing over {tmp_path}/runs/r/checkpoint_{s:08d}" for s in (6, 4)], warned
    assert all("rank 0 of 1 has no completion marker" in w for w in warned)
    assert ckpt.latest_complete_checkpoint(Run.of(cfg)) == got  # no callback: the same pick, quietly


def test_marker_listing_survives_ranks_writing_markers(tmp_path):
    """Ranks sharing a directory: one rank lists its files while another renames its marker
    from .tmp into place. The listing must neither fail on the vanished .tmp nor list markers."""
    import threading

    d = tmp_path / "ck"
    (d / "state").mkdir(parents=True)
    (d / "state" / "w.pt").write_bytes(b"0" * 7)
    stop = threading.Event()

    def other_rank():
        i = 0
        while not stop.is_set():
            storage.write_json(str(d / "complete" / f"rank_{i % 4:05d}.json"), {"files": {}})
            i += 1

    t = threading.Thread(target=other_rank)
    t.start()
    try:
        for _ in range(3000):
            assert storage.file_sizes(str(d), skip_dirs=("complete",)) == {"state/w.pt": 7}
            listed = storage.file_sizes(str(d))  # markers included: still no error on a vanished .tmp
            assert listed["state/w.pt"] == 7
    finally:
        stop.set()
        t.join()


@pytest.mark.slow  # two 2-rank launches
def test_launched_ranks_take_the_launchers_environment_cwd_and_stdout_at_launch(tmp_path, capfd, monkeypatch):
    """Ranks fork from a forkserver started at the first launch; each launch must still look like
    a fresh spawn of the launcher as it is now (TMPDIR for checkpoint conversions, env for tokens
    and endpoints, cwd, and its stdout, here pytest's capture)."""
    for tag in ("first", "second"):
        (tmp_path / tag).mkdir()
        monkeypatch.setenv("VITP_TEST_TAG", tag)
        monkeypatch.setenv("TMPDIR", str(tmp_path / tag))
        monkeypatch.chdir(tmp_path / tag)
        if tag == "first":  # outside this test's capture: the forkserver (if new) starts with other fds
            with capfd.disabled():
                got = launch(workers.launch_context, 2, tag)
        else:
            got = launch(workers.launch_context, 2, tag)
            out = capfd.readouterr().out
            assert "rank 0 of 2 says second" in out and "rank 1 of 2 says second" in out
        assert got == [{"tag": tag, "tmp": str(tmp_path / tag), "cwd": str(tmp_path / tag), "rank": r, "world": 2}
                       for r in range(2)]


@pytest.mark.slow  # three 2-rank launches
def test_launch_retries_when_the_rendezvous_port_was_taken(tmp_path, capfd):
    assert launch(workers.port_taken_on_first_try, 2, str(tmp_path)) == [3.0, 3.0]
    assert "WARNING [driver] rendezvous port taken" in capfd.readouterr().err
    # without retries the collision is the caller's error, naming the cause
    for f in tmp_path.iterdir():
        f.unlink()
    with pytest.raises(RuntimeError, match="(?i)address already in use"):
        launch(workers.port_taken_on_first_try, 2, str(tmp_path), port_retries=0)
