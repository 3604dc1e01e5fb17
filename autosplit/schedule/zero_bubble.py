"""Zero-bubble schedules (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024): ZB-H1 and ZB-V.

Terms:
  F, I, W -- forward; the input-gradient half of backward (it hands the gradient to the previous
             stage); the weight-gradient half, which nothing downstream waits for, so it can fill
             the gaps other schedules leave idle (actions.py).
  round   -- in the steady phase, one F followed by one I (and, once the rank's W delay has passed,
             one W).
  W delay -- ZB-H1: rank ``r`` holds back its first W for ``r`` rounds, so the last ranks, which run
             out of I work first, keep W work for the cooldown that 1F1B leaves idle.
  in flight -- microbatches whose F ran and whose I has not: the activations a rank holds (W keeps
             only the inputs and output gradients of its weight GEMMs, see autosplit/weight_grad.py).

ZB-H1 (v = 1): 1F1B's warmup (``pp - r - 1`` forwards on rank ``r``) and its in-flight bound
(``pp - r``); steady rounds F, I, W with the W delayed by ``r`` rounds; the cooldown runs each
remaining I followed by one pending W, then the last W's.  With unit F = I = W every rank idles
``(pp-1) * (F + I - W) = pp - 1`` steps: a third of 1F1B's ``(pp-1) * (F + B)`` with B = I + W.

ZB-V (v = 2, V placement: rank ``r`` holds stages ``r`` and ``2pp-1-r``): the paper's handcrafted
order, as torch.distributed.pipelining's ``ScheduleZBVZeroBubble`` builds it: ``2(pp-r)-1``
chunk-0 forwards, ``r`` pairs of (chunk-1 F, chunk-0 F), ``pp-r`` triples (chunk-1 F, I, W), then
rounds of (chunk-0 F, I, W; chunk-1 F, I, W), then the cooldown of I's (chunk-0 I's each followed by
a chunk-0 W for the last ``pp-r``) and the remaining W's.  It is built for
``max(m, 2pp-1)`` microbatches and the extra ones dropped, so any m works (with a larger bubble
below ``2pp-1``).  Peak in flight is ``2pp`` chunk-microbatches (``pp`` of a stage of half the size),
1F1B's activation memory.
"""
from __future__ import annotations

from .actions import Action, F, I, W
from .placement import Placement


def zb_h1(rank: int, pp: int, m: int, v: int, place: Placement) -> list[Action]:
    s = place.stage(rank, 0)
    warmup = min(pp - rank - 1, m)
    out = [Action(s, F, i) for i in range(warmup)]
    next_w = 0
    for k in range(m - warmup):
        out += [Action(s, F, warmup + k), Action(s, I, k)]
        if k >= rank:                    # the W delay: rank r keeps r W's for the cooldown
            out.append(Action(s, W, next_w))
            next_w += 1
    for k in range(m - warmup, m):       # cooldown: each I with one pending W
        out.append(Action(s, I, k))
        out.append(Action(s, W, next_w))
        next_w += 1
    return out + [Action(s, W, i) for i in range(next_w, m)]


def zb_v(rank: int, pp: int, m: int, v: int, place: Placement) -> list[Action]:
    n = max(m, 2 * pp - 1)
    s0, s1 = place.stage(rank, 0), place.stage(rank, 1)
    out: list[Action] = []
    count = {(s0, F): 0, (s1, F): 0, (s0, I): 0, (s1, I): 0, (s0, W): 0, (s1, W): 0}

    def add(stage: int, kind) -> None:
        out.append(Action(stage, kind, count[(stage, kind)]))
        count[(stage, kind)] += 1

    for _ in range(2 * (pp - rank) - 1):
        add(s0, F)
    for _ in range(rank):
        add(s1, F)
        add(s0, F)
    for _ in range(pp - rank):
        add(s1, F)
        add(s1, I)
        add(s1, W)
    while count[(s1, F)] < count[(s0, F)] or count[(s0, F)] < n:
        if count[(s0, F)] < n:
            add(s0, F)
        add(s0, I)
        add(s0, W)
        add(s1, F)
        add(s1, I)
        add(s1, W)
    for _ in range(rank):
        add(s0, I)
        add(s1, I)
    for _ in range(pp - rank):
        add(s0, I)
        add(s0, W)
    while count[(s1, W)] < count[(s1, I)]:
        add(s1, W)
    while count[(s0, W)] < count[(s0, I)]:
        add(s0, W)
    return [a for a in out if a.microbatch < m]


def deferring_stages(actions: dict[int, list[Action]], early_send: bool = False) -> set[int]:
    """The stages of compute-only ``actions`` (rank -> list) worth splitting: some W of theirs does not
    directly follow its own I in the rank's list, or (``early_send``) every W does but the stage is not
    the first one.

    A stage whose every W comes right after its I gains from the split only that its I hands the
    input gradient on a W earlier (the first stage hands nothing on: never worth it), while the split
    costs on every microbatch: the split GEMMs' own forward and backward, and a W that reads its
    inputs back cold.  Where the split is cheap (GPUs: ``early_send=True``) the earlier hand-off wins:
    the cost model's timed run puts zb-v at pp = 2, m = 8 1.6 % longer with its last stage fused.
    Where it is not (CPU hosts: ``early_send=False``; there the split stages of that zb-v computed
    F +6 % and I + W +8.5 % over the fused ones in the pipeline benchmark) fusing them wins: that
    zb-v ran 4 % faster with its first and last stage fused than with its first only.
    The runtime keeps a stage outside this set fused: its I runs the whole backward and its W finds
    nothing queued.  ZB-H1: every stage but the first (rank r delays its W's by r rounds) either way;
    ZB-V at pp = 2, m = 8: stages 1 and 2 (the cooldown moves their W's), and 3 with ``early_send``.
    """
    deferring = set()
    for acts in actions.values():
        for pos, a in enumerate(acts):
            if a.kind is not I:
                continue
            moved = pos + 1 == len(acts) or acts[pos + 1] != Action(a.stage, W, a.microbatch)
            if moved or early_send and a.stage > 0:
                deferring.add(a.stage)
    return deferring
