"""The training runtime: a plain interpreter of the plan, in rooms.  Each room's ``__init__`` says what
lives there and what it may import.

Rooms, bottom to top (a room imports its own modules and the rooms below it, never one above;
``tests/test_layering.py`` checks every import, those under ``if TYPE_CHECKING:`` included):

    faults    no rank waits forever: deadlines, heartbeats, the call gate, agreement, input checks
    stage     what a stage module is made of: its layers, activation checkpointing, its parameters
    parallel  the world (process groups, mesh axes) and the parallel collectives: tp, 2D, data
              parallel, FSDP2, the step's gradient reductions, buffers
    state     model state: full state dicts, DCP checkpoints and their files, the fp16 loss scale
    pipeline  the pipeline interpreter: the executor, point-to-point transfers, compiled stages, a
              profiled step

At the top, the entry points: ``parallelize.py`` (``autosplit.parallelize``), ``parallel_module.py``
(ParallelModule), ``rank_plan.py`` (planning inside the job: this rank's runnable share of the Plan),
``auto_mesh.py`` (``mesh="auto"``) and ``profile.py`` (the profile every rank plans with).

Every room may import the graph side (the plan, the compiler's passes, the cost model, the schedule,
``autosplit.tp``, ``autosplit.errors``); nothing on the graph side imports the runtime, and the runtime
never imports ``autosplit.profiling`` (measuring a machine).
"""
