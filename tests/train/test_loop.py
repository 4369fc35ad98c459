"""run_loop's cadence without DeepSpeed or Ray: which steps log, evaluate and checkpoint, and
that on_log is told when the checkpoint of the same step follows."""
import dataclasses

import torch

from vitp.recipes import get_recipe
from vitp.train import checkpoint as ckpt
from vitp.train.loop import LoopHooks, run_loop


class FakeEngine:
    """The slice of a DeepSpeed engine that run_loop / train_step use, over a linear model."""

    def __init__(self, module: torch.nn.Module, grad_accum: int):
        self.module = module
        self.opt = torch.optim.SGD(module.parameters(), lr=0.1)
        self.accum, self.micro = grad_accum, 0

    def __call__(self, x):
        return self.module(x)

    def train(self):
        self.module.train()

    def get_lr(self):
        return [0.1]

    def zero_optimization_stage(self):
        return 0

    def backward(self, loss):
        loss.backward()

    def is_gradient_accumulation_boundary(self):
        return (self.micro + 1) % self.accum == 0

    def step(self):
        if self.is_gradient_accumulation_boundary():
            self.opt.step()
            self.opt.zero_grad()
        self.micro += 1

    def gradient_accumulation_steps(self):
        return self.accum


def _setup(steps=10, log_every=2, checkpoint_every=4, eval_every=3):
    cfg = get_recipe("debug")
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(
        cfg.train, steps=steps, log_every=log_every, checkpoint_every=checkpoint_every,
        eval_every=eval_every))
    S, K, p = cfg.data.image_size, cfg.model.num_classes, cfg.parallel
    module = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * S * S, K))
    module.representation_size = None  # read by run_loop's FLOPs count for a pretrain head
    g = torch.Generator().manual_seed(0)

    def batches(n):
        for _ in range(n):
            yield torch.randn(p.micro_batch, 3, S, S, generator=g), torch.randint(0, K, (p.micro_batch,), generator=g)

    return cfg, FakeEngine(module, p.grad_accum), batches


def test_on_log_is_told_when_a_checkpoint_is_due():
    cfg, engine, batches = _setup()
    events = []
    hooks = LoopHooks(
        on_log=lambda step, m, checkpoint_due: events.append(("log", step, checkpoint_due, "val/top1" in m)),
        on_checkpoint=lambda step, state, m: events.append(("ckpt", step)),
        eval_batches=lambda: batches(2),
    )
    res = run_loop(cfg, engine, batches(10 * cfg.parallel.grad_accum), ckpt.TrainState(), hooks)
    assert res.state.step == 10
    assert events == [
        ("log", 2, False, False), ("log", 3, False, True), ("log", 4, True, False), ("ckpt", 4),
        ("log", 6, False, True), ("log", 8, True, False), ("ckpt", 8), ("log", 9, False, True),
        ("log", 10, True, True), ("ckpt", 10),  # the last step always checkpoints and evaluates
    ]


def test_no_checkpoint_hook_means_never_due():
    cfg, engine, batches = _setup(steps=8, log_every=4, checkpoint_every=4, eval_every=0)
    due = []
    hooks = LoopHooks(on_log=lambda step, m, checkpoint_due: due.append((step, checkpoint_due)))
    run_loop(cfg, engine, batches(8 * cfg.parallel.grad_accum), ckpt.TrainState(), hooks)
    assert due == [(4, False), (8, False)]
