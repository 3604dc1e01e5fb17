"""Sixteen ViT-family architectures nobody on this project wrote, each built tiny for multi-process tests.

Each builder returns timm's (or torchvision's) own model class at the smallest configuration that still
has every part of its architecture: 2 blocks (one per stage of the multi-stage ones), widths 32-64,
2 heads (3-4 in the later stage of the multi-stage ones), 32-64 px images, 10 classes.  Built through
``timm.create_model(name, pretrained=False, ...)`` with the size keywords overridden, except mvitv2,
whose depths and widths live in a config object that ``create_model`` does not let a caller replace.

Terms:
  BATCHNORM -- the models with ``BatchNorm`` layers used in training mode (batch statistics): their
               single-device reference with more than one microbatch is gradient accumulation over the
               same microbatches, each forwarded separately (per-microbatch statistics, as in GPipe).
  IMAGE     -- the input side each model is built for (images are (B, 3, IMAGE, IMAGE)).
"""
from __future__ import annotations

import timm
import torch
import torchvision
from timm.models.mvitv2 import MultiScaleVit, MultiScaleVitCfg

SMALL = dict(pretrained=False, img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2, num_classes=10)


def vit():
    return timm.create_model("vit_tiny_patch16_224", **SMALL)


def deit_distilled():
    """Class and distillation tokens; in training mode the two heads' logits are averaged."""
    return timm.create_model("deit_tiny_distilled_patch16_224", **SMALL)


def deit3():
    """Layer scale, position embedding without the class token."""
    return timm.create_model("deit3_small_patch16_224", **SMALL)


def beit():
    """Relative position bias table indexed by a buffer, added to the attention logits; layer scale."""
    return timm.create_model("beit_base_patch16_224", **SMALL)


def eva02():
    """Rotary position embedding on q and k, SwiGLU MLP with a LayerNorm inside.  mlp_ratio 2, not the
    config's 8/3: a hidden width of 64, not 85, divides over tensor-parallel ranks."""
    return timm.create_model("eva02_tiny_patch14_224", **SMALL, ref_feat_shape=(4, 4), mlp_ratio=2)


def vit_relpos():
    """Relative position bias computed by an MLP from log coordinates, no class token, fc_norm.

    timm hard-codes a dropout of 0.125 on that MLP's hidden layer: random masks, drawn once per forward,
    differ between any two runs (one device with and without microbatches included), so it is set to 0
    here; dropout under parallelism is tested in test_numerics.py."""
    model = timm.create_model("vit_relpos_small_patch16_224", **SMALL)
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    return model


def flexivit():
    return timm.create_model("flexivit_small", **SMALL)


def vit_registers():
    """Four register tokens (DINOv2 style), layer scale."""
    return timm.create_model("vit_small_patch14_reg4_dinov2", **SMALL)


def vit_qknorm():
    """LayerNorm on each head's q and k."""
    return timm.create_model("vit_small_patch16_224", **SMALL, qk_norm=True)


def cait():
    """Talking-heads attention (linears across heads) and one class-attention block."""
    return timm.create_model("cait_xxs24_224", **SMALL, depth_token_only=1)


def xcit():
    """Cross-covariance attention (over channels), convolutional patch embedding and local patch
    interaction with BatchNorm, Fourier position encoding, one class-attention block."""
    return timm.create_model("xcit_nano_12_p16_224", **dict(SMALL, patch_size=8), cls_attn_layers=1)


def levit():
    """Convolution stem, attention with BatchNorm'd linears, an attention-subsampling stage change,
    the distilled pair of heads."""
    return timm.create_model("levit_128s", pretrained=False, img_size=64, embed_dim=(32, 48), key_dim=8,
                             num_heads=(2, 3), depth=(1, 1), num_classes=10)


def pit():
    """Pooling stages: tokens back to a grid, a depthwise strided convolution, and back."""
    return timm.create_model("pit_ti_224", pretrained=False, img_size=32, patch_size=8, stride=4,
                             base_dims=[16, 16], depth=[1, 1], heads=[2, 4], num_classes=10)


def samvit():
    """Windowed attention with padding, one global block, decomposed relative position, a conv neck."""
    return timm.create_model("samvit_base_patch16", **SMALL, window_size=3, global_attn_indexes=(1,),
                             neck_chans=32)


def mvitv2():
    """Pooling attention (strided convolutions on q, k, v), residual pooling, decomposed relative
    position, a stage change that doubles width and heads."""
    cfg = MultiScaleVitCfg(depths=(1, 1), embed_dim=32, num_heads=2, stride_q=((1, 1), (2, 2)),
                           stride_kv_adaptive=(2, 2))
    return MultiScaleVit(cfg, img_size=(32, 32), num_classes=10)


def torchvision_vit():
    """nn.MultiheadAttention inside, class token."""
    return torchvision.models.VisionTransformer(image_size=32, patch_size=8, num_layers=2, num_heads=2,
                                                hidden_dim=32, mlp_dim=64, num_classes=10)


ZOO = {f.__name__: f for f in (vit, deit_distilled, deit3, beit, eva02, vit_relpos, flexivit, vit_registers,
                                vit_qknorm, cait, xcit, levit, pit, samvit, mvitv2, torchvision_vit)}

IMAGE = {name: 64 if name == "levit" else 32 for name in ZOO}


def samvit_windows():
    """samvit at 64 px: an 8 x 8 token grid in 4 x 4 windows, no padding, so 2 rows of windows: on 2 cp ranks
    each holds whole windows (tests/test_context_parallel.py; not a zoo family of its own)."""
    return timm.create_model("samvit_base_patch16", **{**SMALL, "img_size": 64}, window_size=4,
                             global_attn_indexes=(1,), neck_chans=32)


VARIANTS = {"samvit_windows": samvit_windows}      # built by name like the zoo, never iterated with it
IMAGE["samvit_windows"] = 64

BATCHNORM = ("xcit", "levit")


def build(name: str) -> torch.nn.Module:
    """The model ``name`` of ZOO (or VARIANTS) with the weights of seed 0 (every rank builds the same one)."""
    torch.manual_seed(0)
    return ZOO[name]() if name in ZOO else VARIANTS[name]()
