"""The memory model (vitp/model/memory.py) against the ZeRO paper's figures, DeepSpeed's own
estimators, the parameter bytes a real ZeRO-3 engine holds, and the recipes it must admit."""
import pytest

from vitp import recipes
from vitp.model import memory
from vitp.model.flops import param_count
from vitp.model.variants import decode_variant

H14 = param_count("H/14")


def test_the_zero_paper_figures_for_vit_h14():
    """docs/paper.md: ViT-H/14 (632M) 10.1 GB unsharded; 3.5 / 2.4 / 1.3 GB at N = 8."""
    assert H14 == pytest.approx(632e6, rel=1e-3)
    for stage, want in ((0, 10.1), (1, 3.5), (2, 2.4), (3, 1.3)):
        assert memory.paper_states_bytes(H14, stage, 8) / 1e9 == pytest.approx(want, abs=0.05), stage


@pytest.mark.parametrize("variant", ["B/16", "L/16", "H/14"])
@pytest.mark.parametrize("gpus", [1, 2, 8, 64])
def test_model_states_agree_with_deepspeeds_estimators(variant, gpus):
    """Within 5% of DeepSpeed's estimate_zero{2,3}_model_states_mem_needs (no offload)."""
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    P, spec = param_count(variant), decode_variant(variant)
    _, ds2 = estimate_zero2_model_states_mem_needs(P, num_gpus_per_node=gpus, cpu_offload=False)
    ours2 = memory.states_bytes(P, 2, gpus, "bf16")
    assert ours2 == pytest.approx(ds2, rel=0.05)
    largest = memory.largest_layer_params(spec)
    _, ds3, _ = estimate_zero3_model_states_mem_needs(P, largest, num_gpus_per_node=gpus, cpu_offload=False)
    ours3 = memory.states_bytes(P, 3, gpus, "bf16") + 2 * 2 * largest  # + one layer gathered (16-bit w, g)
    assert ours3 == pytest.approx(ds3, rel=0.05)


def test_largest_layer_is_the_largest_module_of_the_real_model():
    from vitp.config import ModelConfig
    from vitp.model.vit import build_vit

    for variant in ("B/16", "H/14"):
        model = build_vit(ModelConfig(variant=variant, num_classes=1000), 224, device="meta")
        biggest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())
        assert memory.largest_layer_params(decode_variant(variant)) == biggest


def test_activations_match_korthikanti_for_h14():
    """docs/paper.md: ~358 MB per image for H/14 (s*h*34 bytes a layer, 16-bit, fused attention)."""
    spec = decode_variant("H/14")
    assert memory.activation_bytes(spec, 224, 1) / 1e6 == pytest.approx(358, rel=0.01)
    assert memory.activation_bytes(spec, 224, 4, "fp32") == 8 * memory.activation_bytes(spec, 224, 1)
    ckpt = memory.activation_bytes(spec, 224, 1, checkpointing=True)
    assert ckpt < memory.activation_bytes(spec, 224, 1) / 8  # layer inputs only, one layer live
    unfused = memory.activation_bytes(spec, 224, 1, fused_attention=False)
    assert unfused - memory.activation_bytes(spec, 224, 1) == 32 * 5 * 16 * 257 * 257


def test_more_workers_never_need_more_memory_and_offload_moves_states_to_the_host():
    for stage in (1, 2, 3):
        per = [memory.estimate("L/16", zero_stage=stage, world=n).states for n in (1, 2, 4, 8)]
        assert per == sorted(per, reverse=True) and per[0] > per[-1]
    on = memory.estimate("L/16", zero_stage=2, world=8, offload_optimizer=True)
    off = memory.estimate("L/16", zero_stage=2, world=8)
    assert on.host > 0 and on.states + on.host == pytest.approx(off.states)


@pytest.mark.parametrize("gpu_mem", [16, 40, 80])
def test_plan_picks_settings_that_fit_and_the_cheapest_first(gpu_mem):
    settings = memory.plan("H/14", gpus=8, gpu_mem_gb=gpu_mem)
    assert settings, "ViT-H/14 fits 8 GPUs of 16 GB with ZeRO-3 / checkpointing"
    for s in settings:
        assert s.estimate.device <= memory.USABLE * gpu_mem * 1e9
        bigger = memory.estimate("H/14", zero_stage=s.zero_stage, world=8, micro_batch=2 * s.micro_batch,
                                 checkpointing=s.checkpointing, offload_optimizer=s.offload,
                                 offload_params=s.offload and s.zero_stage == 3)
        assert s.micro_batch == 256 or bigger.device > memory.USABLE * gpu_mem * 1e9, "not the largest that fits"
    assert [s.cost for s in settings] == sorted(s.cost for s in settings)
    assert not settings[0].offload, "offload only when nothing else fits"


def test_plan_charges_zero_1_and_2_no_communication_over_data_parallel_and_zero_3_half_again():
    """The ZeRO paper's communication volumes: stages 1 and 2 move what data parallelism moves (a
    reduce-scatter and an all-gather are one all-reduce), stage 3 1.5x that. At the same micro-batch
    the plan ranks stage 1 and 2 with stage 0 (a tie broken towards the lower stage) and stage 3
    half again dearer; where stage 1 fits a larger micro-batch than stage 0, it comes first."""
    for gpus, mem in ((8, 80), (8, 40), (32, 80)):
        by = {(s.zero_stage, s.checkpointing, s.offload): s for s in memory.plan("L/16", gpus=gpus, gpu_mem_gb=mem)}
        for ckpt in (False, True):
            base = by.get((0, ckpt, False))
            for stage in (1, 2, 3):
                s = by.get((stage, ckpt, False))
                if base is None or s is None or s.micro_batch != base.micro_batch:
                    continue
                ratio = s.cost / base.cost
                assert (ratio < 1.05 if stage < 3 else ratio > 1.45), (gpus, mem, ckpt, stage, ratio)
                assert s.cost > base.cost  # the tie goes to the stage with less machinery
            z0, z1 = by.get((0, ckpt, False)), by.get((1, ckpt, False))
            if z0 and z1 and z1.micro_batch > z0.micro_batch:
                assert z1.cost < z0.cost, (gpus, mem, ckpt)
    compared = {(gpus, mem) for gpus, mem in ((8, 80), (8, 40), (32, 80))
                if any(s.zero_stage == 1 for s in memory.plan("L/16", gpus=gpus, gpu_mem_gb=mem))}
    assert compared, "no plan with a ZeRO-1 setting to compare"


def test_plan_is_empty_when_nothing_fits():
    assert memory.plan("H/14", gpus=1, gpu_mem_gb=0.1) == []


@pytest.mark.parametrize("name", [n for n, fn in recipes.RECIPES.items() if fn().parallel.use_gpu])
def test_gpu_recipes_fit_an_80gb_gpu(name):
    """Every GPU recipe's own setting fits an H100 (80 GB) by the memory model."""
    cfg = recipes.get_recipe(name)
    p = cfg.parallel
    est = memory.estimate(cfg.model.variant, cfg.data.image_size, zero_stage=p.zero_stage, world=p.num_workers,
                          micro_batch=p.micro_batch, precision=p.precision,
                          checkpointing=cfg.model.grad_checkpointing, offload_optimizer=p.offload_optimizer,
                          offload_params=p.offload_params, num_classes=cfg.model.num_classes)
    assert est.device <= memory.USABLE * 80e9, f"{name}: {est.device / 1e9:.1f} GB per GPU"
