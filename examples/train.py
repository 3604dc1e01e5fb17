"""Train any timm model on an image folder or CIFAR-10 with autosplit (pipeline/tensor/data parallel).

Under torchrun; 8 GPUs, 2 pipeline stages x 2 tensor-parallel ranks x 2 replicas, an ImageNet-style folder:
    torchrun --standalone --nproc-per-node 8 examples/train.py --model vit_base_patch16_224 \
        --data /data/imagenet --mesh 2,2,2 --autocast bf16 --global-batch 512 --num-microbatches 8 \
        --epochs 90 --checkpoint-dir ckpt --resume ckpt --log-every 50
A tiny CPU run: --model vit_tiny_patch16_224 --model-kwargs '{"img_size": 32, "depth": 2}' --data cifar10 --synthetic

--data DIR is a torchvision ImageFolder: DIR/train/<class>/*.jpg with an optional DIR/val/<class>/ (evaluated
after every epoch), or DIR/<class>/*.jpg (no evaluation).  --data cifar10 reads torchvision's CIFAR10 from
--data-root (never downloaded; --synthetic: random CIFAR-shaped images).  The model is
timm.create_model(--model, pretrained=False, num_classes=<the data's>, **--model-kwargs), unchanged;
with --meta it is built on the meta device and every rank initializes only its own shards (timm's ViT
init).  The transforms are timm's for the model (resolve_data_config + create_transform).  The loop,
the flags it shares with train_cifar10.py and the data layout are in examples/common.py.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import timm
import torch
from timm.data import create_transform, resolve_data_config
from torchvision import transforms
from torchvision.datasets import ImageFolder
from torchvision.datasets.folder import find_classes

# The repository root, for `examples.common`.  Appended, not put first: the root also holds the source
# `autosplit/`, which must not shadow the installed package (passes/ and cost_model/ become
# autosplit.passes and autosplit.cost_model only when installed; seen on a GPU with `pip install .`).
sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from examples import common  # noqa: E402
from autosplit.inputs import default_input_shape  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n".join(__doc__.splitlines()[2:]))
    p.add_argument("--model", required=True, help="a timm model name, e.g. vit_base_patch16_224")
    p.add_argument("--model-kwargs", default="{}", metavar="JSON",
                   help='more timm.create_model arguments as a JSON object, e.g. \'{"img_size": 32, "depth": 2}\'')
    p.add_argument("--meta", action="store_true",
                   help="build the model on the meta device: each rank initializes only its own shards")
    p.add_argument("--data", required=True, metavar="DIR|cifar10",
                   help="an image folder (DIR/train/<class>/ and optional DIR/val/<class>/, or DIR/<class>/) or cifar10")
    p.add_argument("--data-root", default="./data", help="with --data cifar10: torchvision's CIFAR10 root (default ./data)")
    common.add_cifar_flags(p)
    common.add_parallel_flags(p)
    common.add_training_flags(p)
    p.set_defaults(global_batch=256)
    return p.parse_args(argv)


def image_folders(root: str) -> tuple[str, str | None]:
    """(train directory, val directory or None) of an image folder."""
    if not os.path.isdir(root):
        sys.exit(f"error: --data {root!r} is neither a directory nor 'cifar10'")
    train = os.path.join(root, "train")
    if not os.path.isdir(train):
        return root, None
    val = os.path.join(root, "val")
    return train, val if os.path.isdir(val) else None


def num_classes(args) -> int:
    return 10 if args.data == "cifar10" else len(find_classes(image_folders(args.data)[0])[0])


def build_model(args, classes: int) -> torch.nn.Module:
    """The timm model, the same on every rank (one seed), or shapes only with --meta."""
    kwargs = json.loads(args.model_kwargs)
    if not isinstance(kwargs, dict):
        sys.exit(f"error: --model-kwargs {args.model_kwargs!r} must be a JSON object")
    if args.meta:
        with torch.device("meta"):
            return timm.create_model(args.model, pretrained=False, num_classes=classes, **kwargs)
    torch.manual_seed(args.seed)
    return timm.create_model(args.model, pretrained=False, num_classes=classes, **kwargs)


def build_datasets(args, model, input_shape, log):
    """(train, val or None, the val set's name), with timm's train and eval transforms for ``model``."""
    config = resolve_data_config({"input_size": input_shape}, model=model)
    train_tf, eval_tf = create_transform(**config, is_training=True), create_transform(**config)
    if args.data == "cifar10":
        to_pil = transforms.ToPILImage()
        train, test = common.cifar10(args, args.data_root, (train_tf, eval_tf),
                                     (transforms.Compose([to_pil, train_tf]), transforms.Compose([to_pil, eval_tf])),
                                     log, fallback=False)
        return train, test, "test"
    train_dir, val_dir = image_folders(args.data)
    train = ImageFolder(train_dir, train_tf)
    val = ImageFolder(val_dir, eval_tf) if val_dir else None
    if val is not None and val.classes != train.classes:
        sys.exit(f"error: {val_dir} has classes {val.classes}, {train_dir} has {train.classes}: they must agree")
    log(f"data: {os.path.abspath(args.data)}: {len(train)} train" + (f" / {len(val)} val" if val else " (no val/)")
        + f" images, {len(train.classes)} classes")
    return train, val, "val"


def main(argv=None) -> int:
    args = parse_args(argv)
    run = common.start(args, "examples/train.py --model vit_tiny_patch16_224 --data cifar10 --synthetic --mesh 2,1,1")
    classes = num_classes(args)
    model = build_model(args, classes)
    input_shape = default_input_shape(model)
    n_params = sum(p.numel() for p in model.parameters())
    init = {"seed": args.seed, "init_fn": common.timm_init} if args.meta else {}
    pm = common.parallelize(model, args, run, input_shape, **init)
    common.describe(pm, args, run)
    run.log(f"model: {args.model} {args.model_kwargs}, {n_params / 1e6:.2f} M params, {classes} classes, input "
            f"{'x'.join(map(str, input_shape))}{', built on meta' if args.meta else ''}; global batch "
            f"{args.global_batch} ({run.replica_batch} per replica)")
    train_set, val_set, val_name = build_datasets(args, model, input_shape, run.log)
    return common.train_and_finish(pm, args, run, train_set, val_set, val_name, input_shape)


if __name__ == "__main__":
    sys.exit(main())
