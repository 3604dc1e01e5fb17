"""``python -m autosplit check``: prove the parallel program on the job's own devices before the long job.

Run under torchrun (any world size, NCCL + CUDA where GPUs are present, gloo + CPU otherwise)::

    torchrun --nproc-per-node 8 -m autosplit check --quick --out check/
    torchrun --nproc-per-node 8 -m autosplit check --parts prediction --model vit_base_patch16_224 \\
        --mesh 2,2,2 --batch 64 --num-microbatches 4

Terms:
  part          -- one of the three checks, run in this order: ``numerics``, ``profile``, ``prediction``
                   (``--parts`` selects); each ends in one ``<part>: PASS ...`` or ``<part>: FAIL ...`` line
                   printed by rank 0, and its record in ``DIR/check.json``.
  configuration -- one way of running the check's tiny ViT over the whole world (configs.py): a name
                   such as ``pp2-1f1b`` or ``tp4-2d``, its mesh (the named axes, dp taking the rest of
                   the world) and its ``parallelize`` options.
  reference     -- the same tiny ViT (same seed, same data) trained by plain PyTorch on this rank's own
                   device, computed on every rank: what every configuration must reproduce (numerics.py).
  action        -- what a rank was doing when a configuration failed: ``parallelize``, ``step k``,
                   ``full_state_dict``, or the comparison (``loss of step k``, ``parameters after k steps``).
  record        -- the JSON-ready dict a part returns: its verdict, its line and its numbers (record.py).
  host group    -- a gloo group over the whole world on which the ranks exchange their records
                   (job.py); never the NCCL default group, so gathering them waits on no GPU queue.
  mutation      -- the hidden test hook ``AUTOSPLIT_CHECK_MUTATE=<configuration>`` (mutate.py): one
                   rank perturbs what it feeds its collectives while that configuration trains, so the
                   numerics part can be shown to fail by name.
"""
