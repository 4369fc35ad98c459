"""The embedded pre-training corpus is learnable: the debug recipe's tiny ViT, trained 60 steps
on 10 fractal classes at 32 px (plain torch, no Ray), sees its loss fall well below ln(10)."""
import numpy as np
import pytest
import torch

from vitp.config import ModelConfig
from vitp.data.decode import resize_center_crop
from vitp.data.ingest import normalize
from vitp.data.synth import class_system, render


@pytest.mark.long(reason="checks the synthetic data or import costs, whose subjects change rarely")
@pytest.mark.slow
def test_fractal_corpus_is_learnable_by_pico_vit():
    from vitp.model.vit import build_vit

    torch.manual_seed(0)
    imgs, labels = [], []
    for c in range(10):
        system = class_system(0, c)
        for i in range(64):
            imgs.append(resize_center_crop(render(0, c, i, 40, system), 32))
            labels.append(c)
    x_all = torch.from_numpy(np.stack(imgs))  # (640, 32, 32, 3) uint8
    y_all = torch.tensor(labels)
    model = build_vit(ModelConfig(variant="pico/8", num_classes=10, head="pretrain"), 32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    g = torch.Generator().manual_seed(0)
    losses = []
    for step in range(150):  # posed fractals: the shape, not the place, tells the class
        idx = torch.randint(0, len(y_all), (32,), generator=g)
        x = normalize(x_all[idx]).contiguous()
        loss = torch.nn.functional.cross_entropy(model(x), y_all[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    first, last = np.mean(losses[:5]), np.mean(losses[-10:])
    assert first > 2.0 and last < first - 0.5, (first, last)
