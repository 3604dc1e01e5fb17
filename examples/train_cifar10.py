"""Train a timm ViT on CIFAR-10 with autosplit (pipeline, tensor and data parallel), under torchrun.

The small case of examples/train.py: a ViT built by hand for 32x32 images (--depth, --width, --heads,
--patch) and CIFAR-10's own augmentation; the flags, the loop and the data layout are examples/common.py's.

CPU (gloo), 2 pipeline stages:
    torchrun --standalone --nproc-per-node 2 examples/train_cifar10.py --mesh 2,1,1 --data ./data
GPUs (NCCL), 2 stages x 2 replicas:
    torchrun --standalone --nproc-per-node 4 examples/train_cifar10.py --mesh 2,1,2 --data ./data --autocast bf16
No dataset at hand (offline machine): add --synthetic (random CIFAR-shaped images, see common.SyntheticCIFAR).
--report DIR writes the plan it trains with (plan.dump: report.html, per-rank code, plan.json).
The old flags --bf16, --microbatches, --batch and --checkpoint still work for one release, with a warning.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
from timm.models.vision_transformer import VisionTransformer
from torchvision import transforms

# The repository root, for `examples.common`.  Appended, not put first: the root also holds the source
# `autosplit/`, which must not shadow the installed package (passes/ and cost_model/ become
# autosplit.passes and autosplit.cost_model only when installed; seen on a GPU with `pip install .`).
sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from examples import common  # noqa: E402

CIFAR_MEAN, CIFAR_STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)


class Deprecated(argparse.Action):
    """An old flag kept for one release: prints a warning naming its replacement, then sets the new
    flag's value (``value``, or the one given on the command line)."""

    def __init__(self, option_strings, dest, replacement: str, value=None, **kwargs):
        self.replacement, self.value = replacement, value
        new = f"{replacement} {value}" if value is not None else replacement
        super().__init__(option_strings, dest, nargs=0 if value is not None else None, default=argparse.SUPPRESS,
                         help=f"deprecated: use {new}", **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        new = f"{self.replacement} {self.value}" if self.value is not None else self.replacement
        if os.environ.get("RANK", "0") == "0":
            print(f"warning: {option_string} is deprecated and will be removed in the next release; use {new}",
                  file=sys.stderr)
        setattr(namespace, self.dest, self.value if self.value is not None else values)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", default="./data", help="torchvision CIFAR10 root (download=False)")
    common.add_cifar_flags(p)
    common.add_parallel_flags(p)
    common.add_training_flags(p)
    p.add_argument("--depth", type=int, default=12, help="transformer blocks (default 12)")
    p.add_argument("--width", type=int, default=192, help="embedding dim (default 192)")
    p.add_argument("--heads", type=int, default=None, help="attention heads (default: width // 64, at least 1)")
    p.add_argument("--patch", type=int, default=4, help="patch size in pixels (default 4)")
    p.add_argument("--bf16", action=Deprecated, dest="autocast", replacement="--autocast", value="bf16")
    p.add_argument("--checkpoint", action=Deprecated, dest="recompute", replacement="--recompute", value="stage")
    p.add_argument("--microbatches", action=Deprecated, dest="num_microbatches", replacement="--num-microbatches",
                   type=int)
    p.add_argument("--batch", action=Deprecated, dest="global_batch", replacement="--global-batch", type=int)
    return p.parse_args(argv)


def build_datasets(args, log):
    """CIFAR-10 (or synthetic) with CIFAR's augmentation: a padded random crop and a horizontal flip."""
    normalize = transforms.Normalize(CIFAR_MEAN, CIFAR_STD)
    augment = [transforms.RandomCrop(32, padding=4), transforms.RandomHorizontalFlip(), normalize]
    to_tensor = transforms.ToTensor()
    real = (transforms.Compose([to_tensor, *augment]), transforms.Compose([to_tensor, normalize]))
    return common.cifar10(args, args.data, real, (transforms.Compose(augment), normalize), log, fallback=True)


def main(argv=None) -> int:
    args = parse_args(argv)
    run = common.start(args, "examples/train_cifar10.py --mesh 2,1,1 --synthetic")
    torch.manual_seed(args.seed)    # every rank builds the same model
    heads = args.heads or max(1, args.width // 64)
    model = VisionTransformer(img_size=32, patch_size=args.patch, embed_dim=args.width, depth=args.depth,
                              num_heads=heads, num_classes=10)
    pm = common.parallelize(model, args, run, (3, 32, 32))
    n_params = sum(p.numel() for p in model.parameters())
    common.describe(pm, args, run)
    run.log(f"model: ViT depth {args.depth}, width {args.width}, heads {heads}, patch {args.patch}, "
            f"{n_params / 1e6:.2f} M params; global batch {args.global_batch} ({run.replica_batch} per replica)")
    train_set, test_set = build_datasets(args, run.log)
    return common.train_and_finish(pm, args, run, train_set, test_set, "test", (3, 32, 32))


if __name__ == "__main__":
    sys.exit(main())
