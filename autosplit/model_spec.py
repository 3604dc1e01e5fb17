"""A model named on the command line, built on the meta device.

Terms:
  spec -- a timm model name (``vit_base_patch16_224``) or ``package.module:factory`` (a callable that
          returns an nn.Module).  Used by ``autosplit plan`` / ``search`` and ``autosplit check``'s
          prediction part; its own module so that the check imports no command-line entry point.
"""
from __future__ import annotations

import importlib

import torch

from autosplit.errors import AutosplitError


def build_model(spec: str, img_size: int | None = None) -> torch.nn.Module:
    """A model on the meta device from a timm name or 'package.module:factory'."""
    with torch.device("meta"):
        if ":" in spec:
            module_name, _, factory = spec.partition(":")
            return getattr(importlib.import_module(module_name), factory)()
        import timm
        if spec not in timm.list_models():
            raise AutosplitError(f"unknown model {spec!r}: not a timm model name (see timm.list_models('vit*')) "
                                 f"and not of the form 'package.module:factory'")
        kwargs = {"img_size": img_size} if img_size else {}
        return timm.create_model(spec, pretrained=False, **kwargs)
