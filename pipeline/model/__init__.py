"""The ViT family: model, variants, analytic FLOPs, position-embedding resampling.

Plain torch: nothing here knows about Ray or DeepSpeed.
"""
from ..config import PAPER_VARIANTS, VARIANTS, ViTSpec, decode_variant
from .flops import forward_flops, mfu, param_count, training_flops
from .vit import ViT, adapt_state_dict, build_vit, resample_pos_embed

__all__ = [
    "PAPER_VARIANTS", "VARIANTS", "ViTSpec", "decode_variant", "forward_flops", "mfu",
    "param_count", "training_flops", "ViT", "adapt_state_dict", "build_vit", "resample_pos_embed",
]
