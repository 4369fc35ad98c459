"""The ViT family: variants.py (shapes, no torch), vit.py (the model), flops.py (analytic FLOPs),
attention.py, convert.py. Import the submodule you need: this file imports nothing, so that
`vitp.model.variants` (read by config validation) does not pull in torch.
"""
