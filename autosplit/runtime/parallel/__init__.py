"""The parallel collectives: everything that talks over the tensor- and data-parallel axes.

  world.py                  process group, device, mesh axes and their groups
  tp_collectives.py         tensor parallelism's runtime half: groups, waits, autograd functions
  tp2d_collectives.py       2D's ``linear_2d`` (both forms) and ``sum_stats``
  traceable_collectives.py  the collectives as custom ops torch.compile traces without a graph break
  data_parallel.py          gradients averaged over dp in buckets, overlapped with the last backward
  fsdp.py                   ``dp_shard``: stage modules sharded over dp with FSDP2
  gradients.py              the step's gradient and loss reductions: partial gradients, mean loss, norm
  buffers.py                buffers kept equal across replicas

May import: the graph side (autosplit.tp, mesh, weight_grad); of the runtime, faults and stage.
"""
