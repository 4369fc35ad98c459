"""The Vision Transformer of Dosovitskiy et al. (eq. 1-4), readable top to bottom.

Patchify (or a hybrid's ResNet, resnet.py) -> linear projection -> [class] token + 1-D position
embedding -> L pre-LN blocks (layers.py) -> final LayerNorm -> head (or masked patch prediction, mpp.py).
Initialisation follows the official JAX code. No Ray or DeepSpeed: parallelism is applied in `vitp.train`.
"""
from __future__ import annotations

import contextlib
import math
from typing import Callable, ContextManager, Literal, Optional, Sequence

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..config import ModelConfig
from .layers import Block, PatchEmbed, drop_path_rates
from .mpp import MPPHead, colour_targets
from .resnet import HybridEmbed, ResNetNorm
from .variants import ViTSpec, decode_variant

# gather(params): a context in which partitioned params are whole (see ViT.init_weights)
Gather = Callable[[Sequence[nn.Parameter]], ContextManager]


def _whole(params: Sequence[nn.Parameter]) -> ContextManager:
    return contextlib.nullcontext()


@contextlib.contextmanager
def _drawn_in_fp32(params: Sequence[nn.Parameter]):
    """Initial values are drawn in fp32 and rounded once into 16-bit parameters, so a build made
    in bf16 (ZeRO-3 partitions in the training dtype) equals an fp32 build cast to bf16."""
    low = [p for p in params if p.dtype != torch.float32]
    kept = [p.data for p in low]
    for p in low:
        p.data = p.data.float()
    try:
        yield
    finally:
        for p, data in zip(low, kept):
            data.copy_(p.data)
            p.data = data


def full_shape(p: torch.Tensor) -> torch.Size:
    """A parameter's shape, also when ZeRO-3 has partitioned it (DeepSpeed's `ds_shape`)."""
    return getattr(p, "ds_shape", p.shape)


# flax's lecun_normal is a truncated normal whose std is corrected for the truncation at 2 sigma.
_TRUNC_STD_CORRECTION = 0.87962566103423978


def lecun_normal_(w: torch.Tensor) -> torch.Tensor:
    """Truncated-normal with variance 1/fan_in (flax `lecun_normal`), for Dense and Conv kernels."""
    fan_in = w[0].numel()  # (out, in) or (out, in, kh, kw): everything but the output dim
    std = math.sqrt(1.0 / fan_in) / _TRUNC_STD_CORRECTION
    return nn.init.trunc_normal_(w, std=std, a=-2 * std, b=2 * std)


class ViT(nn.Module):
    """Vision Transformer.

    Args:
        variant: "B/16"-style string or a ViTSpec (depth, width, mlp_dim, heads, patch).
        image_size: square input resolution; must be a multiple of the patch size.
        num_classes: K, the head's output width.
        pool: "cls" reads the class token (paper); "gap" averages the patch tokens.
        head: "pretrain" = tanh pre-logits layer of width `representation_size` then linear;
            "finetune" = a single zero-initialised linear layer (pre-logits dropped).
        representation_size: pre-logits width (default: the model width D).
        dropout / attn_dropout: dropout after the embedding, in the MLPs / on attention weights.
        drop_path: stochastic depth of the last block (linear from 0 at the first; drop_path_rates).
        head_bias: the head's initial bias (0, the official code; about -log(num_classes) for a sigmoid loss).
        grad_checkpointing: recompute each block in backward to save activation memory.
        resnet_norm: a hybrid's weight-standardisation / GroupNorm epsilons, "bit" (official)
            or "timm" (see vitp.model.resnet).
        mpp: add the masked-patch-prediction [mask] embedding and colour head (`self.mpp`),
            used by `forward(x, mpp=True)`; downstream loads drop them (`adapt_state_dict`).
    """

    def __init__(
        self,
        variant: str | ViTSpec = "B/16",
        image_size: int = 224,
        num_classes: int = 1000,
        pool: Literal["cls", "gap"] = "cls",
        head: Literal["pretrain", "finetune"] = "finetune",
        representation_size: Optional[int] = None,
        dropout: float = 0.0,
        attn_dropout: float = 0.0,
        drop_path: float = 0.0,
        head_bias: float = 0.0,
        grad_checkpointing: bool = False,
        in_chans: int = 3,
        init: bool = True,
        resnet_norm: ResNetNorm = "bit",
        mpp: bool = False,
    ):
        super().__init__()
        spec = decode_variant(variant) if isinstance(variant, str) else variant
        if image_size % spec.stride:
            raise ValueError(
                f"image_size {image_size} is not divisible by {spec.name}'s token size {spec.stride}: "
                f"use a multiple of {spec.stride}"
            )
        self.spec, self.image_size, self.num_classes = spec, image_size, num_classes
        self.pool, self.head_type, self.head_bias = pool, head, head_bias
        self.grad_checkpointing = grad_checkpointing
        D = spec.width
        self.grid = image_size // spec.stride
        num_patches = self.grid**2

        if spec.hybrid:
            self.patch_embed = HybridEmbed(spec.resnet, spec.resnet_width, spec.patch, D, resnet_norm, in_chans)
        else:
            self.patch_embed = PatchEmbed(spec.patch, D, in_chans)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, D))
        self.pos_embed = nn.Parameter(torch.zeros(1, num_patches + 1, D))  # (1, N+1, D)
        self.pos_drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(
            Block(D, spec.mlp_dim, spec.heads, dropout, attn_dropout, rate)
            for rate in drop_path_rates(drop_path, spec.depth)
        )
        self.norm = nn.LayerNorm(D, eps=1e-6)
        if head == "pretrain":
            self.representation_size = representation_size or D
            self.pre_logits = nn.Sequential(nn.Linear(D, self.representation_size), nn.Tanh())
        else:
            self.representation_size = D
            self.pre_logits = nn.Identity()
        self.head = nn.Linear(self.representation_size, num_classes)
        self.mpp = MPPHead(D) if mpp else None
        if init:  # init=False: the caller runs init_weights (e.g. with a ZeRO-3 gather)
            self.init_weights()

    # ------------------------------------------------------------------ initialisation
    def init_groups(self) -> list[list[nn.Parameter]]:
        """The parameters in the order `init_weights` and `load_grouped` visit them: the embedding,
        then one block at a time, then the final norm and head (a partitioned model gathers one
        group at a time, never the whole model)."""
        embed = [*self.patch_embed.parameters(), self.pos_embed, self.cls_token]  # (hybrid: ResNet first)
        tail = [*self.norm.parameters(), *self.pre_logits.parameters(), *self.head.parameters(),
                *(self.mpp.parameters() if self.mpp is not None else ())]
        return [embed, *(list(b.parameters()) for b in self.blocks), tail]

    @torch.no_grad()
    def init_weights(self, gather: Optional[Gather] = None) -> None:
        """As the official code: xavier-uniform Dense in the encoder (MLP biases ~N(0, 1e-6)),
        lecun-normal patch embedding and pre-logits, pos-embed ~N(0, 0.02), class token and
        head zero (so logits are exactly 0 at step 0), LayerNorm 1/0.

        `gather(params)`: a context in which partitioned `params` are whole and what is written
        to them is kept (DeepSpeed ZeRO-3's GatheredParameters); the random draws are the same
        as an unpartitioned build's."""
        if self.patch_embed.proj.weight.is_meta:
            return
        gather = gather or _whole
        embed, *blocks, tail = self.init_groups()
        with gather(embed), _drawn_in_fp32(embed):
            if self.spec.hybrid:
                self.patch_embed.backbone.init_weights(lecun_normal_)
            lecun_normal_(self.patch_embed.proj.weight)
            nn.init.zeros_(self.patch_embed.proj.bias)
            nn.init.normal_(self.pos_embed, std=0.02)
            nn.init.zeros_(self.cls_token)
        for blk, params in zip(self.blocks, blocks):
            with gather(params), _drawn_in_fp32(params):
                # the JAX code initialises q, k, v as three separate D x D kernels
                for w in blk.attn.qkv.weight.chunk(3, dim=0):
                    nn.init.xavier_uniform_(w)
                nn.init.xavier_uniform_(blk.attn.proj.weight)
                nn.init.zeros_(blk.attn.qkv.bias)
                nn.init.zeros_(blk.attn.proj.bias)
                for lin in (blk.mlp.fc1, blk.mlp.fc2):
                    nn.init.xavier_uniform_(lin.weight)
                    nn.init.normal_(lin.bias, std=1e-6)
                for norm in (blk.norm1, blk.norm2):
                    nn.init.ones_(norm.weight)
                    nn.init.zeros_(norm.bias)
        with gather(tail), _drawn_in_fp32(tail):
            nn.init.ones_(self.norm.weight)
            nn.init.zeros_(self.norm.bias)
            if isinstance(self.pre_logits, nn.Sequential):
                lecun_normal_(self.pre_logits[0].weight)
                nn.init.zeros_(self.pre_logits[0].bias)
            self.zero_head()
            if self.mpp is not None:
                self.mpp.init_weights()

    @torch.no_grad()
    def zero_head(self) -> None:
        """A new head: zero weights (logits equal at step 0) and bias `head_bias`."""
        nn.init.zeros_(self.head.weight)
        nn.init.constant_(self.head.bias, self.head_bias)

    def no_weight_decay(self) -> set[str]:
        """Parameter names excluded from weight decay: biases, norms, pos-embed, class token."""
        out = {"pos_embed", "cls_token", *(("mpp.mask_token",) if self.mpp is not None else ())}
        for name, p in self.named_parameters():
            if len(full_shape(p)) <= 1:  # also when ZeRO-3 has partitioned p
                out.add(name)
        return out

    # ------------------------------------------------------------------ forward
    def embed(self, x: torch.Tensor) -> torch.Tensor:
        """Images (B, C, H, W) -> token sequence z_0 (B, N+1, D) (eq. 1)."""
        return self._with_cls_and_pos(self.patch_embed(x))

    def _with_cls_and_pos(self, x: torch.Tensor) -> torch.Tensor:
        """Patch embeddings (B, N, D) -> [class] token prepended, position embeddings added."""
        if x.shape[1] != self.pos_embed.shape[1] - 1:
            raise ValueError(
                f"input gives {x.shape[1]} patches but the model was built for "
                f"{self.pos_embed.shape[1] - 1} ({self.image_size}px): resize the input or build the "
                "model at this resolution and load with vitp.model.loading.adapt_state_dict"
            )
        cls = self.cls_token.expand(x.shape[0], -1, -1)  # (B, 1, D)
        x = torch.cat([cls, x], dim=1) + self.pos_embed  # (B, N+1, D)
        return self.pos_drop(x)

    def forward_features(self, x: torch.Tensor, tokens: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Images (or given patch embeddings `tokens`) -> final-LayerNorm tokens (B, N+1, D)."""
        x = self.embed(x) if tokens is None else self._with_cls_and_pos(tokens)
        for blk in self.blocks:
            if self.grad_checkpointing and self.training and torch.is_grad_enabled():
                x = checkpoint(blk, x, use_reentrant=False)
            else:
                x = blk(x)
        return self.norm(x)

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        """Tokens (B, N+1, D) -> logits (B, K); `pre_logits=True` returns the features the
        few-shot evaluator uses (B, R)."""
        x = x[:, 0] if self.pool == "cls" else x[:, 1:].mean(dim=1)  # (B, D)
        x = self.pre_logits(x)  # (B, R)
        return x if pre_logits else self.head(x)

    def representation(self, x: torch.Tensor) -> torch.Tensor:
        """The features a linear probe reads (B, R): the pre-logits; for a masked-patch-prediction
        model, whose class token and pre-logits no loss trained, the mean final patch token (B, D)."""
        z = self.forward_features(x)
        return z[:, 1:].mean(dim=1) if self.mpp is not None else self.forward_head(z, pre_logits=True)

    def forward(self, x: torch.Tensor, mpp: bool = False, generator: Optional[torch.Generator] = None):
        """Logits (B, K); with `mpp`: masked patch prediction on a corrupted copy of the patch
        embeddings, returning (colour logits (B, N, 512), corrupted positions (B, N) bool)."""
        if not mpp:
            return self.forward_head(self.forward_features(x))
        if self.mpp is None:
            raise ValueError("this model has no masked-patch-prediction head: build it with mpp=True")
        tokens, corrupted = self.mpp(self.patch_embed(x), generator)
        z = self.forward_features(x, tokens)
        return self.mpp.head(z[:, 1:]), corrupted

    def colour_targets(self, images: torch.Tensor, mean, std) -> torch.Tensor:
        """The masked-patch-prediction targets of `images` (B, N): see vitp.model.mpp."""
        return colour_targets(images, self.spec.stride, mean, std)

    @torch.no_grad()
    def attention_maps(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Per-layer attention weights [(B, H, N+1, N+1)] for rollout / attention distance."""
        maps = []
        z = self.embed(x)
        for blk in self.blocks:
            maps.append(blk.attn.attention_weights(blk.norm1(z)))
            z = blk(z)
        return maps


def build_vit(cfg: ModelConfig, image_size: int, device: torch.device | str | None = None,
              init: bool = True, mpp: bool = False) -> ViT:
    """The model a config describes (on `device`; "meta" allocates nothing; init=False leaves
    the initialisation to the caller's `init_weights`; `mpp` adds the masked-patch head)."""
    with torch.device(device or "cpu"):
        return ViT(
            cfg.variant, image_size=image_size, num_classes=cfg.num_classes, pool=cfg.pool,
            head=cfg.head, representation_size=cfg.representation_size, dropout=cfg.dropout,
            attn_dropout=cfg.attn_dropout, drop_path=cfg.drop_path, head_bias=cfg.head_bias,
            grad_checkpointing=cfg.grad_checkpointing, init=init,
            resnet_norm=cfg.resnet_norm, mpp=mpp,
        )
