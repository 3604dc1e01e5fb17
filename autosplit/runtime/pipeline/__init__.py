"""The pipeline interpreter: one rank's lowered schedule, run in order.

  executor.py         computes and communication groups of one pipeline rank, as the schedule lists them
  p2p.py              stage boundaries sent between pipeline ranks, one group at a time
  compiled_stages.py  ``compile_stages``: this rank's stage modules through torch.compile
  trace_step.py       one training step under torch.profiler, merged into one Chrome trace

May import: the graph side (schedule, weight_grad); of the runtime, faults, stage and parallel.
"""
