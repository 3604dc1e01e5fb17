"""Model state: what a job saves, restores and reads back.

  state_dict.py            the original model's full state dict, from and to one rank's stage shards
  model_state.py           a ParallelModule's full state dict, on every rank
  checkpoint.py            sharded checkpoints with torch.distributed.checkpoint (DCP)
  checkpoint_files.py      a checkpoint directory: versions, the atomic commit, export to a state dict
  checkpoint_chunks.py     one rank's tensors as DCP entries under the original names
  checkpoint_optimizer.py  the optimizer in a checkpoint, in torch's own layout
  checkpoint_state.py      the rest: loss scale, random states, extras
  safe_load.py             reading a checkpoint's pickles against an allow-list: no code in it runs
  loss_scaler.py           dynamic fp16 loss scaling, decided alike on every rank

May import: of the runtime, faults, stage and parallel.
"""
