"""Pipeline schedules as data: generate compute-only lists, lower them, simulate them.

Terms: ``pp`` pipeline ranks, ``v`` chunks per rank, ``m`` microbatches; global stage ``s = c*pp + r``
is chunk ``c`` of rank ``r`` (looped placement).  See each module's docstring for the rest.

    sched = build_schedule("interleaved", pp=4, num_microbatches=8, chunks_per_rank=2)
    lists = lower(sched)                  # rank -> [Action] with SEND_*/RECV_* inserted
    result = simulate(sched)              # raises ScheduleDeadlock if it cannot finish
    print(result.format_grid(), result.idle_fraction)
"""
from .actions import Action, ActionKind
from .generate import SCHEDULES, Schedule, build_schedule
from .lower import lower
from .simulate import ScheduleDeadlock, SimResult, check_schedule, simulate

__all__ = [
    "Action", "ActionKind", "SCHEDULES", "Schedule", "build_schedule", "lower",
    "ScheduleDeadlock", "SimResult", "check_schedule", "simulate",
]
