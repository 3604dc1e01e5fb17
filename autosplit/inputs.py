"""What a model takes as input, when the user has not said.

Terms:
  input shape -- (C, H, W) of one image, read from the model's own configuration: timm's
                 ``pretrained_cfg["input_size"]`` (or the patch embedding's ``img_size``), torchvision's
                 ``image_size``.  Never guessed from module names.
"""
from __future__ import annotations

import torch

from autosplit.errors import AutosplitError


def default_input_shape(model: torch.nn.Module, image_size: int | None = None) -> tuple[int, int, int]:
    cfg = getattr(model, "pretrained_cfg", None) or getattr(model, "default_cfg", None) or {}
    embed = getattr(model, "patch_embed", None)
    if embed is not None and getattr(embed, "img_size", None) is not None:    # timm, built with its own img_size
        h, w = embed.img_size
        chans = getattr(getattr(embed, "proj", None), "in_channels", 3)
        return (chans, image_size or h, image_size or w)
    if "input_size" in cfg:
        c, h, w = cfg["input_size"]
        return (c, image_size or h, image_size or w)
    if isinstance(getattr(model, "image_size", None), int):                    # torchvision's ViT
        size = image_size or model.image_size
        return (3, size, size)
    raise AutosplitError(f"cannot tell the input size of {type(model).__name__}: pass example_input=<one "
                         f"microbatch> (or --image-size on the command line)")
