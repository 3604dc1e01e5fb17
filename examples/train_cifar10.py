"""Train a timm ViT on CIFAR-10 with autosplit (pipeline, tensor and data parallel), under torchrun.

CPU (gloo), 2 pipeline stages:
    torchrun --standalone --nproc-per-node 2 examples/train_cifar10.py --mesh 2,1,1 --data ./data
GPUs (NCCL), 2 stages x 2 replicas:
    torchrun --standalone --nproc-per-node 4 examples/train_cifar10.py --mesh 2,1,2 --data ./data --bf16
No dataset at hand (offline machine): add --synthetic (random CIFAR-shaped images, see SyntheticCIFAR).
--report DIR writes the plan it trains with (plan.dump: report.html, per-rank code, plan.json).

Data layout: the global batch of --batch images is split over the dp replicas; replica k trains on
rows [k*B/dp, (k+1)*B/dp).  Every rank of a replica (its pp stages) must see the very same tensors, so
the sampler is a DistributedSampler over the dp axis with one seed, and the random augmentation of
sample i in epoch e is seeded from (seed, e, i) -- the same on every rank, whatever the worker count.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time

import torch
import torch.distributed as dist
from timm.models.vision_transformer import VisionTransformer
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from torchvision import transforms
from tqdm import tqdm

import autosplit
from autosplit.mesh import MeshShape
from autosplit.options import LINEAR_2D_FORMS, TP_MODES
from autosplit.report.dump import dump_plan
from autosplit.schedule import SCHEDULES

CIFAR_MEAN, CIFAR_STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mesh", default="2,1,1", help="PP,TP,DP (dp may be -1: what the world size leaves)")
    p.add_argument("--schedule", default="1f1b", choices=SCHEDULES, help="pipeline schedule (default 1f1b)")
    p.add_argument("--tp-mode", default="1d", choices=TP_MODES, help="tensor-parallel layout (default 1d, Megatron)")
    p.add_argument("--tp-2d-form", default="auto", choices=("auto",) + LINEAR_2D_FORMS,
                   help="with --tp-mode 2d: how each linear multiplies its blocks (default: the cost model's choice)")
    p.add_argument("--chunks-per-rank", type=int, default=1, help="model chunks per rank (interleaved: >= 2)")
    p.add_argument("--microbatches", type=int, default=8, help="microbatches per replica batch")
    p.add_argument("--batch", type=int, default=128, help="global batch (all dp replicas together)")
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--lr", type=float, default=1e-3, help="peak AdamW learning rate (warmup, then cosine)")
    p.add_argument("--weight-decay", type=float, default=0.05)
    p.add_argument("--warmup-steps", type=int, default=None, help="default: 5%% of the steps")
    p.add_argument("--steps", type=int, default=None, help="stop after this many steps (smoke runs)")
    p.add_argument("--eval-batches", type=int, default=None, help="evaluate on at most this many batches")
    p.add_argument("--data", default="./data", help="torchvision CIFAR10 root (download=False)")
    p.add_argument("--synthetic", action="store_true", help="random CIFAR-shaped data instead of CIFAR-10")
    p.add_argument("--workers", type=int, default=2, help="DataLoader workers per rank")
    p.add_argument("--bf16", action="store_true", help="autocast to bfloat16")
    p.add_argument("--checkpoint", action="store_true", help="recompute each stage's forward in backward")
    p.add_argument("--compile-stages", action="store_true", help="run every stage module through torch.compile")
    p.add_argument("--compile-mode", default=None, choices=("default", "reduce-overhead", "max-autotune"),
                   help="torch.compile's mode (with --compile-stages)")
    p.add_argument("--sequence-parallel", action="store_true",
                   help="with tp > 1, also shard tokens between tensor-parallel regions")
    p.add_argument("--save", default=None, help="write the full state dict here (rank 0) at the end")
    p.add_argument("--checkpoint-dir", default=None, metavar="DIR",
                   help="save a sharded checkpoint (model and optimizer, every rank its own part) after each epoch")
    p.add_argument("--resume", default=None, metavar="DIR",
                   help="continue from the latest complete checkpoint in DIR (any mesh may have written it); "
                        "start afresh when DIR holds none yet (resume if present)")
    p.add_argument("--stop-after-epochs", type=int, default=None, metavar="K",
                   help="stop after K of --epochs epochs (the schedule still spans --epochs); resume later")
    p.add_argument("--export", default=None, metavar="FILE",
                   help="at the end, write the last checkpoint as a plain state dict for the unchanged timm model "
                        "(needs --checkpoint-dir)")
    p.add_argument("--train-size", type=int, default=50_000, help="synthetic training images (default 50000)")
    p.add_argument("--report", default=None, metavar="DIR",
                   help="write the plan (report.html, per-rank stage code, plan.json) to DIR (rank 0)")
    p.add_argument("--log-every", type=int, default=0, metavar="K", help="print the loss every K steps (0: never)")
    p.add_argument("--depth", type=int, default=12)
    p.add_argument("--width", type=int, default=192, help="embedding dim")
    p.add_argument("--heads", type=int, default=None, help="default: width // 64 (at least 1)")
    p.add_argument("--patch", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


class SyntheticCIFAR(Dataset):
    """CIFAR-shaped stand-in: uniform noise plus a faint per-class colour tint, random labels.

    Sample i is generated from (seed, i) on demand, so every rank sees the same data.  The tint makes
    the task learnable, so a falling loss and rising accuracy show that training works end to end.
    """

    def __init__(self, n: int, seed: int, transform):
        self.n, self.seed, self.transform = n, seed, transform
        g = torch.Generator().manual_seed(1234)
        self.colors = torch.rand(10, 3, 1, 1, generator=g)

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
        label = int(torch.randint(10, (), generator=g))
        image = 0.7 * torch.rand(3, 32, 32, generator=g) + 0.3 * self.colors[label]
        return self.transform(image), label


class SeededAugment(Dataset):
    """Seed the global RNG from (seed, epoch, index) around each sample's transforms."""

    def __init__(self, dataset: Dataset, seed: int):
        self.dataset, self.seed, self.epoch = dataset, seed, 0

    def set_epoch(self, epoch: int):
        self.epoch = epoch

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, i):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(((self.seed * 1009 + self.epoch) * 10_000_019 + i) % 2**63)
            return self.dataset[i]


def build_datasets(args, log):
    normalize = transforms.Normalize(CIFAR_MEAN, CIFAR_STD)
    augment = [transforms.RandomCrop(32, padding=4), transforms.RandomHorizontalFlip(), normalize]
    if not args.synthetic:
        try:
            from torchvision.datasets import CIFAR10
            to_tensor = transforms.ToTensor()
            train = CIFAR10(args.data, train=True, download=False,
                            transform=transforms.Compose([to_tensor, *augment]))
            test = CIFAR10(args.data, train=False, download=False,
                           transform=transforms.Compose([to_tensor, normalize]))
            log(f"data: CIFAR-10 from {os.path.abspath(args.data)} ({len(train)} train / {len(test)} test)")
            return train, test
        except RuntimeError as exc:   # torchvision: "Dataset not found or corrupted"
            log(f"WARNING: CIFAR-10 not found under {os.path.abspath(args.data)!r} ({exc}).\n"
                f"WARNING: falling back to SYNTHETIC data -- the accuracy below is NOT CIFAR-10 accuracy.")
    train = SyntheticCIFAR(args.train_size, args.seed + 1, transforms.Compose(augment))
    test = SyntheticCIFAR(10_000, args.seed + 2, normalize)
    log(f"data: SYNTHETIC random CIFAR-shaped images (noise + per-class tint), {len(train)} train / "
        f"{len(test)} held-out -- not CIFAR-10")
    return train, test


@torch.no_grad()
def evaluate(pm, test_set, replica_batch, dp, dp_rank, max_batches, workers):
    """Accuracy over the test set: replica k takes samples k, k+dp, ...; the last batch is zero-padded
    to the plan's shape and the padding is not counted."""
    indices = list(range(dp_rank, len(test_set), dp))
    n_batches = math.ceil(math.ceil(len(test_set) / dp) / replica_batch)   # the same on every replica
    if max_batches is not None:
        n_batches = min(n_batches, max_batches)
    loader = DataLoader(torch.utils.data.Subset(test_set, indices), batch_size=replica_batch, shuffle=False,
                        num_workers=workers)
    batches = iter(loader)
    correct = torch.zeros(2, dtype=torch.float64)   # [correct, counted]
    for _ in range(n_batches):
        images, labels = next(batches, (torch.zeros(0, 3, 32, 32), torch.zeros(0, dtype=torch.long)))
        valid = images.shape[0]
        if valid < replica_batch:
            images = torch.cat([images, images.new_zeros(replica_batch - valid, *images.shape[1:])])
        logits = pm.predict(images).float().cpu()
        correct[0] += (logits[:valid].argmax(-1) == labels).sum()
        correct[1] += valid
    # Every rank of a replica holds the same counts: sum over the world, divide by ranks per replica.
    dist.all_reduce(correct)
    correct /= dist.get_world_size() // dp
    return (correct[0] / correct[1].clamp(min=1)).item(), int(correct[1].item())


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.export and not args.checkpoint_dir:
        raise SystemExit("--export writes the last checkpoint as a plain state dict: give --checkpoint-dir too")
    if "WORLD_SIZE" not in os.environ:
        sys.exit("run me under torchrun, e.g.: torchrun --standalone --nproc-per-node 2 "
                 "examples/train_cifar10.py --mesh 2,1,1 --synthetic")
    world_size = int(os.environ["WORLD_SIZE"])
    try:
        mesh = MeshShape.parse(args.mesh, world_size=world_size)
    except autosplit.AutosplitError as exc:
        sys.exit(f"error: --mesh {args.mesh}: {exc}")
    if args.batch % mesh.dp or (args.batch // mesh.dp) % args.microbatches:
        sys.exit(f"--batch {args.batch} must split into dp={mesh.dp} replica batches, each divisible by "
                 f"--microbatches {args.microbatches}")
    replica_batch = args.batch // mesh.dp
    rank0 = int(os.environ.get("RANK", "0")) == 0

    def log(msg):
        if rank0:
            tqdm.write(msg, file=sys.stdout)
            sys.stdout.flush()

    torch.manual_seed(args.seed)    # every rank builds the same model
    heads = args.heads or max(1, args.width // 64)
    model = VisionTransformer(img_size=32, patch_size=args.patch, embed_dim=args.width, depth=args.depth,
                              num_heads=heads, num_classes=10)
    example = torch.empty(replica_batch // args.microbatches, 3, 32, 32)
    pm = autosplit.parallelize(model, mesh=(mesh.pp, mesh.tp, mesh.dp), loss_fn=torch.nn.CrossEntropyLoss(),
                               num_microbatches=args.microbatches, schedule=args.schedule,
                               chunks_per_rank=args.chunks_per_rank, tp_mode=args.tp_mode, example_input=example,
                               autocast=torch.bfloat16 if args.bf16 else None,
                               checkpoint="stage" if args.checkpoint else None,
                               sequence_parallel=args.sequence_parallel,
                               compile_stages=({"mode": args.compile_mode} if args.compile_mode else True)
                               if args.compile_stages else False,
                               **({"tp_2d_form": args.tp_2d_form} if args.tp_mode == "2d" else {}))
    n_params = sum(p.numel() for p in model.parameters())
    log(f"world: {world_size} ranks, backend {pm.world.backend}, device {pm.world.device.type}; "
        f"mesh pp={mesh.pp} tp={mesh.tp} dp={mesh.dp}; schedule {args.schedule}, tp mode {args.tp_mode}, "
        f"{args.microbatches} microbatches of {example.shape[0]}")
    log(f"model: ViT depth {args.depth}, width {args.width}, heads {heads}, patch {args.patch}, "
        f"{n_params / 1e6:.2f} M params; global batch {args.batch} ({replica_batch} per replica)")
    log(pm.plan.summary())
    if args.report and rank0:   # planning is pure: one rank writes it, no other rank waits
        dump_plan(pm.plan, args.report, profile=pm.profile)
        log(f"report: {os.path.abspath(os.path.join(args.report, 'report.html'))}")

    train_set, test_set = build_datasets(args, log)
    train_set = SeededAugment(train_set, args.seed)
    sampler = DistributedSampler(train_set, num_replicas=pm.dp_size, rank=pm.dp_rank, shuffle=True,
                                 seed=args.seed, drop_last=True)
    loader = DataLoader(train_set, batch_size=replica_batch, sampler=sampler, drop_last=True,
                        num_workers=args.workers)
    steps_per_epoch = len(loader)
    total_steps = args.epochs * steps_per_epoch
    if args.steps is not None:
        total_steps = min(total_steps, args.steps)
    warmup = args.warmup_steps if args.warmup_steps is not None else max(1, total_steps // 20)

    opt = torch.optim.AdamW(pm.parameters(), lr=args.lr, weight_decay=args.weight_decay)

    def lr_factor(step):
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, total_steps - warmup)))

    step, start = 0, time.perf_counter()
    if args.resume:     # the learning rate follows the step, so a resumed run continues the same schedule
        record = pm.load_checkpoint(args.resume, optimizer=opt, missing_ok=True)
        if record is None:
            log(f"no committed checkpoint in {args.resume} yet: starting afresh")
        else:
            step = record["step"]
            log(f"resumed from {args.resume} at step {step} (saved on mesh {tuple(record['mesh'])})")
    last_epoch = args.epochs if args.stop_after_epochs is None else min(args.epochs, args.stop_after_epochs)
    for epoch in range(step // steps_per_epoch, last_epoch):
        if step >= total_steps:
            break
        sampler.set_epoch(epoch)
        train_set.set_epoch(epoch)
        bar = tqdm(total=min(steps_per_epoch, total_steps - step), desc=f"epoch {epoch + 1}/{args.epochs}",
                   disable=not rank0, dynamic_ncols=True, file=sys.stderr)
        loss_sum, seen, epoch_start = 0.0, 0, time.perf_counter()
        for images, labels in loader:
            t0 = time.perf_counter()
            loss = pm.step(images, labels)
            pm.clip_grad_norm_(1.0)
            for group in opt.param_groups:
                group["lr"] = args.lr * lr_factor(step)
            opt.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            loss_sum += loss
            seen += 1
            bar.set_postfix(loss=f"{loss:.4f}", img_s=f"{args.batch / (time.perf_counter() - t0):.0f}")
            bar.update()
            if args.log_every and step % args.log_every == 0:
                log(f"step {step}: loss {loss:.4f}")
            if not math.isfinite(loss):
                log(f"ERROR: loss is {loss} at step {step}; stopping")
                dist.destroy_process_group()
                return 1
            if step >= total_steps:
                break
        bar.close()
        elapsed = time.perf_counter() - epoch_start
        acc, counted = evaluate(pm, test_set, replica_batch, pm.dp_size, pm.dp_rank, args.eval_batches,
                                args.workers)
        log(f"epoch {epoch + 1}/{args.epochs}: step {step}, train loss {loss_sum / max(seen, 1):.4f} "
            f"(last {loss:.4f}), {seen * args.batch / elapsed:.0f} img/s; "
            f"test accuracy {100 * acc:.2f}% on {counted} images")
        if args.checkpoint_dir:         # a collective: every rank writes its own blocks, rank 0 commits
            path = pm.save_checkpoint(args.checkpoint_dir, optimizer=opt)
            log(f"checkpoint: {path}")

    log(f"done: {step} steps in {time.perf_counter() - start:.1f} s")
    if args.save:
        state = pm.full_state_dict()    # a collective: every rank takes part
        if rank0:
            torch.save(state, args.save)
            log(f"saved the full state dict ({len(state)} tensors) to {args.save}")
    if args.export and rank0:
        from autosplit.runtime.state.checkpoint_files import export_state_dict
        state = export_state_dict(args.checkpoint_dir, args.export)
        log(f"exported {len(state)} tensors to {args.export}")
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
