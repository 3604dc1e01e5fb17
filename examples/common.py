"""What examples/train.py and examples/train_cifar10.py share: one flag vocabulary, data-parallel data
loading, the timm ViT init for meta models, CIFAR-10 (real or synthetic), and the training loop (AdamW
with warmup then cosine, metrics lines, a progress bar, evaluation, checkpoints and resume).

Data layout: the global batch of --global-batch images is split over the dp replicas; replica k trains
on rows [k*B/dp, (k+1)*B/dp).  Every rank of a replica (its pipeline stages, its tensor-parallel ranks)
must feed pm.step the very same tensors, so the sampler is a DistributedSampler over the dp axis only
(num_replicas=pm.dp_size, rank=pm.dp_rank) with one seed, and the random augmentation of sample i in
epoch e is seeded from (seed, e, i): the same on every rank, whatever --workers is.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import os
import random
import sys
import time
from typing import Callable

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Subset
from tqdm import tqdm

import autosplit
from autosplit.mesh import MeshShape
from autosplit.options import LINEAR_2D_FORMS, TP_MODES
from autosplit.report.dump import dump_plan
from autosplit.schedule import SCHEDULES

AUTOCAST = {"bf16": torch.bfloat16, "fp16": torch.float16}
DP_SHARD = {"off": False, "stage": "stage", "layer": "layer", "auto": True}


# ---- flags ---------------------------------------------------------------------------------------------
def add_parallel_flags(p: argparse.ArgumentParser) -> None:
    """How the model is split and what one optimizer step takes."""
    p.add_argument("--mesh", default="2,1,1", help="PP,TP,DP (dp may be -1: what the world size leaves), or "
                                                        "pp=..,cp=..,tp=..,dp=.. with a context-parallel axis")
    p.add_argument("--schedule", default="1f1b", choices=SCHEDULES, help="pipeline schedule (default 1f1b)")
    p.add_argument("--chunks-per-rank", type=int, default=1, help="model chunks per rank (interleaved, zb-v: 2)")
    p.add_argument("--tp-mode", default="1d", choices=TP_MODES, help="tensor-parallel layout (default 1d, Megatron)")
    p.add_argument("--tp-2d-form", default="auto", choices=("auto",) + LINEAR_2D_FORMS,
                   help="with --tp-mode 2d: how each linear multiplies its blocks (default: the cost model's choice)")
    p.add_argument("--global-batch", type=int, default=128,
                   help="samples per optimizer step over all dp replicas (default %(default)s)")
    p.add_argument("--num-microbatches", type=int, default=8, help="microbatches per replica batch (default %(default)s)")
    p.add_argument("--autocast", default=None, choices=tuple(AUTOCAST), help="autocast dtype (default: float32)")
    p.add_argument("--recompute", default=None, choices=("stage", "block"),
                   help="recompute each stage's (or each block's) activations in backward")
    p.add_argument("--dp-shard", default="off", choices=tuple(DP_SHARD),
                   help="FSDP2 over the dp axis: off (replicated), per stage, per layer, or the cost model's choice")
    p.add_argument("--sequence-parallel", action="store_true",
                   help="with tp > 1, also shard tokens between tensor-parallel regions")
    p.add_argument("--compile-stages", action="store_true", help="run every stage module through torch.compile")
    # the modes without CUDA graphs: "reduce-overhead" and "max-autotune" are refused (docs/parallel-modes.md)
    p.add_argument("--compile-mode", default=None, choices=("default", "max-autotune-no-cudagraphs"),
                   help="torch.compile's mode (with --compile-stages); the CUDA-graph modes are refused")


def add_training_flags(p: argparse.ArgumentParser) -> None:
    """The optimizer, the loop, logging, evaluation and checkpoints."""
    p.add_argument("--epochs", type=int, default=10, help="epochs; the LR schedule spans them (default 10)")
    p.add_argument("--steps", type=int, default=None, help="stop after this many steps in all (smoke runs)")
    p.add_argument("--lr", type=float, default=1e-3, help="peak AdamW learning rate (warmup, then cosine)")
    p.add_argument("--weight-decay", type=float, default=0.05, help="AdamW weight decay (default 0.05)")
    p.add_argument("--warmup-steps", type=int, default=None, help="linear warmup steps (default: 5%% of the steps)")
    p.add_argument("--workers", type=int, default=2, help="DataLoader workers per rank (default 2)")
    p.add_argument("--eval-batches", type=int, default=None, help="evaluate on at most this many batches")
    p.add_argument("--log-every", type=int, default=0, metavar="K",
                   help="every K steps, rank 0 prints step, loss, lr, images/s and step time (0: never)")
    p.add_argument("--checkpoint-dir", default=None, metavar="DIR",
                   help="save a sharded checkpoint (model, optimizer, LR scheduler) after each epoch, every "
                        "--save-every steps and at the end")
    p.add_argument("--save-every", type=int, default=0, metavar="N",
                   help="with --checkpoint-dir, also save every N steps (0: only after each epoch)")
    p.add_argument("--resume", default=None, metavar="DIR",
                   help="continue from the latest complete checkpoint in DIR (any mesh may have written it); "
                        "start afresh when DIR holds none yet")
    p.add_argument("--stop-after-epochs", type=int, default=None, metavar="K",
                   help="stop after K of --epochs epochs (the schedule still spans --epochs); resume later")
    p.add_argument("--export", default=None, metavar="FILE",
                   help="at the end, write the last checkpoint as a plain state dict of the unchanged model "
                        "(needs --checkpoint-dir)")
    p.add_argument("--save", default=None, metavar="FILE", help="write the full state dict here (rank 0) at the end")
    p.add_argument("--report", default=None, metavar="DIR",
                   help="write the plan (report.html, per-rank stage code, plan.json) to DIR (rank 0)")
    p.add_argument("--seed", type=int, default=0, help="model, sampler and augmentation seed (default 0)")


def add_cifar_flags(p: argparse.ArgumentParser) -> None:
    """CIFAR-10 stand-in data for machines without the data set."""
    p.add_argument("--synthetic", action="store_true", help="random CIFAR-shaped data instead of CIFAR-10")
    p.add_argument("--train-size", type=int, default=50_000, help="synthetic training images (default 50000)")


# ---- the world, the plan ---------------------------------------------------------------------------------
@dataclasses.dataclass
class Run:
    """This process's view of the job: the resolved mesh, batch sizes and a rank-0 logger."""
    world_size: int
    mesh: MeshShape
    replica_batch: int
    rank0: bool

    def log(self, msg: str) -> None:
        if self.rank0:
            tqdm.write(msg, file=sys.stdout)
            sys.stdout.flush()


def start(args, usage: str) -> Run:
    """Check the launch and the batch arithmetic before any process group exists."""
    if args.export and not args.checkpoint_dir:
        sys.exit("--export writes the last checkpoint as a plain state dict: give --checkpoint-dir too")
    if "WORLD_SIZE" not in os.environ:
        sys.exit(f"run me under torchrun, e.g.: torchrun --standalone --nproc-per-node 2 {usage}")
    world_size = int(os.environ["WORLD_SIZE"])
    try:
        mesh = MeshShape.parse(args.mesh, world_size=world_size)
    except autosplit.AutosplitError as exc:
        sys.exit(f"error: --mesh {args.mesh}: {exc}")
    if args.global_batch % mesh.dp or (args.global_batch // mesh.dp) % args.num_microbatches:
        sys.exit(f"--global-batch {args.global_batch} must split into dp={mesh.dp} replica batches, each "
                 f"divisible by --num-microbatches {args.num_microbatches}")
    return Run(world_size, mesh, args.global_batch // mesh.dp, int(os.environ.get("RANK", "0")) == 0)


def parallelize(model: torch.nn.Module, args, run: Run, input_shape, **kwargs):
    """autosplit.parallelize with the parallel flags; ``kwargs`` adds e.g. seed= and init_fn=."""
    example = torch.empty(run.replica_batch // args.num_microbatches, *input_shape)
    compile_stages = ({"mode": args.compile_mode} if args.compile_mode else True) if args.compile_stages else False
    return autosplit.parallelize(
        model, mesh=run.mesh, loss_fn=torch.nn.CrossEntropyLoss(),
        num_microbatches=args.num_microbatches, schedule=args.schedule, chunks_per_rank=args.chunks_per_rank,
        tp_mode=args.tp_mode, example_input=example, autocast=AUTOCAST.get(args.autocast),
        dp_shard=DP_SHARD[args.dp_shard], sequence_parallel=args.sequence_parallel, compile_stages=compile_stages,
        recompute=args.recompute, **({"tp_2d_form": args.tp_2d_form} if args.tp_mode == "2d" else {}),
        **kwargs)


def describe(pm, args, run: Run) -> None:
    """The world line, the plan's summary and, with --report, the plan on disk (rank 0 only)."""
    mesh = run.mesh
    run.log(f"world: {run.world_size} ranks, backend {pm.world.backend}, device {pm.world.device.type}; "
            f"mesh {mesh}; schedule {args.schedule}, tp mode {args.tp_mode}, "
            f"{args.num_microbatches} microbatches of {run.replica_batch // args.num_microbatches}")
    run.log(pm.plan.summary())
    if args.report and run.rank0:   # planning is pure: one rank writes it, no other rank waits
        dump_plan(pm.plan, args.report, profile=pm.profile)
        run.log(f"report: {os.path.abspath(os.path.join(args.report, 'report.html'))}")


def timm_init(name: str, t: torch.Tensor) -> None:
    """timm's ViT init (init_weights_vit_timm) as an ``init_fn`` for a model built on the meta device:
    called in place on every parameter and buffer at full shape, torch's generator seeded from (seed, name)."""
    from timm.layers import trunc_normal_
    if name in ("cls_token", "reg_token"):
        torch.nn.init.normal_(t, std=1e-6)
    elif t.dim() == 4:                                 # patch embedding: PyTorch's Conv2d default, as timm keeps it
        torch.nn.init.kaiming_uniform_(t, a=math.sqrt(5))
    elif name == "pos_embed" or t.dim() == 2:          # position embedding and every Linear weight
        trunc_normal_(t, std=.02)
    elif name.endswith("bias"):
        torch.nn.init.zeros_(t)
    else:                                              # norm weights
        torch.nn.init.ones_(t)


# ---- data ------------------------------------------------------------------------------------------------
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


def cifar10(args, root: str, real: tuple, synthetic: tuple, log, fallback: bool):
    """(train, test) CIFAR-10 from torchvision's layout under ``root`` (never downloaded) with the
    ``real`` (PIL) transforms, or, with --synthetic, SyntheticCIFAR with the ``synthetic`` (tensor) ones.
    Without the data set: fall back to synthetic data with a warning, or exit (``fallback=False``)."""
    if not args.synthetic:
        from torchvision.datasets import CIFAR10
        try:
            train = CIFAR10(root, train=True, download=False, transform=real[0])
            test = CIFAR10(root, train=False, download=False, transform=real[1])
            log(f"data: CIFAR-10 from {os.path.abspath(root)} ({len(train)} train / {len(test)} test)")
            return train, test
        except RuntimeError as exc:   # torchvision: "Dataset not found or corrupted"
            if not fallback:
                sys.exit(f"error: CIFAR-10 not found under {os.path.abspath(root)!r} ({exc}); download it first "
                         f"(examples/README.md) or pass --synthetic")
            log(f"WARNING: CIFAR-10 not found under {os.path.abspath(root)!r} ({exc}).\n"
                f"WARNING: falling back to SYNTHETIC data -- the accuracy below is NOT CIFAR-10 accuracy.")
    train = SyntheticCIFAR(args.train_size, args.seed + 1, synthetic[0])
    test = SyntheticCIFAR(10_000, args.seed + 2, synthetic[1])
    log(f"data: SYNTHETIC random CIFAR-shaped images (noise + per-class tint), {len(train)} train / "
        f"{len(test)} held-out -- not CIFAR-10")
    return train, test


class SeededAugment(Dataset):
    """Seed torch's and Python's global RNGs from (seed, epoch, index) around each sample's transforms
    (torchvision's draw from torch, timm's RandomResizedCrop from ``random``)."""

    def __init__(self, dataset: Dataset, seed: int):
        self.dataset, self.seed, self.epoch = dataset, seed, 0

    def set_epoch(self, epoch: int):
        self.epoch = epoch

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, i):
        sample_seed = ((self.seed * 1009 + self.epoch) * 10_000_019 + i) % 2**63
        state = random.getstate()
        try:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(sample_seed)
                random.seed(sample_seed)
                return self.dataset[i]
        finally:
            random.setstate(state)


class ResumableSampler(DistributedSampler):
    """A DistributedSampler that can skip the first ``skip`` samples of its epoch (a mid-epoch resume)."""

    skip = 0

    def __iter__(self):
        return iter(list(super().__iter__())[self.skip:])

    def __len__(self):
        return super().__len__() - self.skip


@torch.no_grad()
def evaluate(pm, dataset, run: Run, input_shape, max_batches: int | None, workers: int):
    """Accuracy over ``dataset``: replica k takes samples k, k+dp, ...; the last batch is zero-padded
    to the plan's shape and the padding is not counted.  Returns (accuracy, images counted)."""
    dp, batch = pm.dp_size, run.replica_batch
    n_batches = math.ceil(math.ceil(len(dataset) / dp) / batch)   # the same on every replica
    if max_batches is not None:
        n_batches = min(n_batches, max_batches)
    loader = DataLoader(Subset(dataset, range(pm.dp_rank, len(dataset), dp)), batch_size=batch, num_workers=workers)
    batches = iter(loader)
    correct = torch.zeros(2, dtype=torch.float64)   # [correct, counted]
    for _ in range(n_batches):
        images, labels = next(batches, (torch.zeros(0, *input_shape), torch.zeros(0, dtype=torch.long)))
        valid = images.shape[0]
        if valid < batch:
            images = torch.cat([images, images.new_zeros(batch - valid, *images.shape[1:])])
        logits = pm.predict(images).float().cpu()
        correct[0] += (logits[:valid].argmax(-1) == labels).sum()
        correct[1] += valid
    # Every rank of a replica holds the same counts: sum over the world (on the backend's device: NCCL
    # reduces only CUDA tensors), divide by ranks per replica.
    correct = correct.to(pm.world.device)
    dist.all_reduce(correct)
    correct = correct.cpu() / (run.world_size // dp)
    return (correct[0] / correct[1].clamp(min=1)).item(), int(correct[1].item())


# ---- the loop --------------------------------------------------------------------------------------------
def warmup_cosine(warmup: int, total: int) -> Callable[[int], float]:
    """The LR factor of step ``step`` (0-based): linear warmup, then cosine to 0 at ``total``."""
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))
    return factor


class Trainer:
    """pm.step over the epochs with AdamW and a warmup-cosine LambdaLR; rank 0 logs and shows progress."""

    def __init__(self, pm, args, run: Run, train_set, val_set, val_name: str, input_shape):
        self.pm, self.args, self.run = pm, args, run
        self.val_set, self.val_name, self.input_shape = val_set, val_name, input_shape
        self.train_set = SeededAugment(train_set, args.seed)
        self.sampler = ResumableSampler(self.train_set, num_replicas=pm.dp_size, rank=pm.dp_rank, shuffle=True,
                                        seed=args.seed, drop_last=True)
        self.loader = DataLoader(self.train_set, batch_size=run.replica_batch, sampler=self.sampler,
                                 drop_last=True, num_workers=args.workers)
        self.steps_per_epoch = self.sampler.num_samples // run.replica_batch
        if self.steps_per_epoch == 0:
            sys.exit(f"error: {len(train_set)} training images make no batch of --global-batch {args.global_batch}")
        self.total_steps = args.epochs * self.steps_per_epoch
        if args.steps is not None:
            self.total_steps = min(self.total_steps, args.steps)
        warmup = args.warmup_steps if args.warmup_steps is not None else max(1, self.total_steps // 20)
        self.opt = torch.optim.AdamW(pm.parameters(), lr=args.lr, weight_decay=args.weight_decay)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, warmup_cosine(warmup, self.total_steps))
        self.step, self.saved_step = 0, None
        self.mark = (0, time.perf_counter())     # (step, time) of the last metrics line

    def resume(self) -> None:
        """--resume: model, optimizer, LR scheduler and step from the latest checkpoint, if there is one."""
        record = self.pm.load_checkpoint(self.args.resume, optimizer=self.opt, extra={"lr_scheduler": self.sched},
                                         missing_ok=True)
        if record is None:
            self.run.log(f"no committed checkpoint in {self.args.resume} yet: starting afresh")
            return
        self.step = self.saved_step = record["step"]
        self.run.log(f"resumed from {self.args.resume} at step {self.step} (saved on mesh {tuple(record['mesh'])})")

    def save(self) -> None:
        """A collective: every rank writes its own blocks, rank 0 commits."""
        if self.args.checkpoint_dir and self.saved_step != self.step:
            path = self.pm.save_checkpoint(self.args.checkpoint_dir, optimizer=self.opt,
                                           extra={"lr_scheduler": self.sched})
            self.saved_step = self.step
            self.run.log(f"checkpoint: {path}")

    def train(self) -> int:
        """Every epoch from the resumed step on; 1 when the loss stops being finite, else 0."""
        start = time.perf_counter()
        if self.args.resume:
            self.resume()
        last_epoch = self.args.epochs if self.args.stop_after_epochs is None else \
            min(self.args.epochs, self.args.stop_after_epochs)
        for epoch in range(self.step // self.steps_per_epoch, last_epoch):
            if self.step >= self.total_steps:
                break
            if not self.epoch(epoch):
                return 1
        self.run.log(f"done: {self.step} steps in {time.perf_counter() - start:.1f} s")
        return 0

    def epoch(self, epoch: int) -> bool:
        """One epoch (the rest of it after a mid-epoch resume), then evaluation and a checkpoint."""
        done_in_epoch = self.step - epoch * self.steps_per_epoch
        self.sampler.set_epoch(epoch)
        self.sampler.skip = done_in_epoch * self.run.replica_batch
        self.train_set.set_epoch(epoch)
        todo = min(self.steps_per_epoch - done_in_epoch, self.total_steps - self.step)
        bar = tqdm(total=todo, desc=f"epoch {epoch + 1}/{self.args.epochs}", disable=not self.run.rank0,
                   dynamic_ncols=True, file=sys.stderr)
        losses, epoch_start = [], time.perf_counter()
        self.mark = (self.step, epoch_start)
        for images, labels in self.loader:
            losses.append(self.one_step(images, labels))
            bar.set_postfix(loss=f"{losses[-1]:.4f}", lr=f"{self.opt.param_groups[0]['lr']:.2e}")
            bar.update()
            if not math.isfinite(losses[-1]):
                bar.close()
                self.run.log(f"ERROR: loss is {losses[-1]} at step {self.step}; stopping")
                return False
            if len(losses) >= todo:
                break
        bar.close()
        self.end_of_epoch(epoch, losses, time.perf_counter() - epoch_start)
        return True

    def one_step(self, images, labels) -> float:
        """Forward and backward of the global batch, the optimizer and scheduler steps, the metrics line."""
        loss = self.pm.step(images, labels)
        self.pm.clip_grad_norm_(1.0)
        lr = self.opt.param_groups[0]["lr"]
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.sched.step()
        self.step += 1
        if self.args.log_every and self.step % self.args.log_every == 0:
            self.log_metrics(loss, lr)
        if self.args.save_every and self.step % self.args.save_every == 0:
            self.save()
        return loss

    def log_metrics(self, loss: float, lr: float) -> None:
        """``step S: loss L  lr X  N img/s  T s/step``, the rates over the steps since the last line."""
        (step0, t0), now = self.mark, time.perf_counter()
        steps, seconds = self.step - step0, max(now - t0, 1e-9)
        self.run.log(f"step {self.step}: loss {loss:.4f}  lr {lr:.3e}  "
                     f"{steps * self.args.global_batch / seconds:.1f} img/s  {seconds / steps:.3f} s/step")
        self.mark = (self.step, now)

    def end_of_epoch(self, epoch: int, losses: list, seconds: float) -> None:
        """The epoch's line (mean loss, throughput, accuracy on the held-out set if any), then a checkpoint."""
        line = (f"epoch {epoch + 1}/{self.args.epochs}: step {self.step}, train loss "
                f"{sum(losses) / len(losses):.4f} (last {losses[-1]:.4f}), "
                f"{len(losses) * self.args.global_batch / seconds:.0f} img/s")
        if self.val_set is not None:
            acc, counted = evaluate(self.pm, self.val_set, self.run, self.input_shape, self.args.eval_batches,
                                    self.args.workers)
            line += f"; {self.val_name} accuracy {100 * acc:.2f}% on {counted} images"
        self.run.log(line)
        self.save()


def train_and_finish(pm, args, run: Run, train_set, val_set, val_name: str, input_shape) -> int:
    """Train (from --resume), then --save and --export; leave the process group.  The exit status."""
    status = Trainer(pm, args, run, train_set, val_set, val_name, input_shape).train()
    if status == 0:
        finish(pm, args, run)
    dist.destroy_process_group()
    return status


def finish(pm, args, run: Run) -> None:
    """--save and --export (collectives: every rank calls this)."""
    if args.save:
        state = pm.full_state_dict()    # a collective: every rank takes part
        if run.rank0:
            torch.save(state, args.save)
            run.log(f"saved the full state dict ({len(state)} tensors) to {args.save}")
    if args.export and run.rank0:
        from autosplit.runtime.state.checkpoint_files import export_state_dict
        state = export_state_dict(args.checkpoint_dir, args.export)
        run.log(f"exported {len(state)} tensors to {args.export}")
    dist.barrier()
