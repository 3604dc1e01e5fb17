"""Measuring a machine's cost-model profile: the device's kernels and its network, in a live job.

What is here runs before any plan exists and is never part of training: the training runtime
(``autosplit/runtime/``) does not import this package (``tests/test_layering.py`` checks it, transitively);
it reads what this package measured only as a profile, from the cache (cost_model/profile_cache.py) or a
profile file (cost_model/profile_file.py, ``device="profile.json"``).  This package sits above the runtime:
it measures with the runtime's own World, Watchdog, collectives and transport.

Terms:
  job        -- processes started by torchrun (RANK, WORLD_SIZE, LOCAL_WORLD_SIZE in the environment) or with
                torch.distributed already initialized; every rank of it calls the measurement together.
  alone      -- one process, no job: only this device is measured (no collectives).
Modules:
  job.py             -- ``autosplit.measure_profile(path=None)``: the public entry point (in a job or alone).
  cli.py             -- ``python -m autosplit profile --out profile.json [--seconds S]``.
  measure_profile.py -- a job's measurement, agreed on by every rank and cached; ``--ranks N`` spawns one on CPU.
  device_bench.py    -- the device's kernel model: a GEMM sweep, fused attention, a copy, tiny ops.
  kernel_fit.py      -- the kernel model's fits to those timings (pure).
  comm_bench.py      -- collectives per group size and node span, point to point, posting (CPU).
  sharing_bench.py, resume_bench.py, pipeline_bench.py, cpu_workload.py -- what ranks sharing a CPU host
                        cost each other, a pass resumed after a wait, and a reference pipeline (CPU only).
"""
