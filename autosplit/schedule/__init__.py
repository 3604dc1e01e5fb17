"""Pipeline schedules as data: generate compute-only lists, lower them, simulate them.

Terms: ``pp`` pipeline ranks, ``v`` chunks per rank, ``m`` microbatches; which global stage chunk ``c``
of rank ``r`` runs is the schedule's placement (placement.py: looped ``c*pp + r``, or zb-v's V).
See each module's docstring for the rest.

    sched = build_schedule("interleaved", pp=4, num_microbatches=8, chunks_per_rank=2)
    lists = lower(sched)                  # rank -> [Action | Group]: computes, and groups of SEND_*/RECV_*
    result = simulate(sched)              # NCCL's rules; raises ScheduleDeadlock if it cannot finish
    print(result.format_grid(), result.idle_fraction)
"""
from .actions import Action, ActionKind, Group, Item, parse_item
from .generate import SCHEDULES, SPLIT_BACKWARD, Schedule, build_schedule, forward_schedule
from .lower import flatten, lower
from .placement import Placement, placement_of
from .simulate import SimResult, check_schedule, peak_in_flight, simulate
from .timing import ScheduleDeadlock
from .zero_bubble import deferring_stages

__all__ = [
    "Action", "ActionKind", "Group", "Item", "parse_item", "SCHEDULES", "SPLIT_BACKWARD", "Schedule",
    "build_schedule", "Placement", "placement_of",
    "forward_schedule", "lower", "flatten", "ScheduleDeadlock", "SimResult", "check_schedule", "peak_in_flight",
    "simulate", "deferring_stages",
]
