"""Keep freed host memory inside the process when training on CPU: no page faults per activation.

Terms:
  page fault   -- the kernel mapping a zero-filled page into the process on its first touch (a few
                  microseconds per 4 KiB page, including the zeroing).
  mmap / trim  -- glibc's malloc serves a block above ``M_MMAP_THRESHOLD`` with its own ``mmap`` and
                  unmaps it on free; the threshold starts at 128 KiB and rises with the freed blocks'
                  sizes up to 32 MiB.  It also returns the top of its heap to the kernel once more than
                  ``M_TRIM_THRESHOLD`` (twice the mmap threshold) is free there.  Either way, the next
                  block of that size faults every page in again.
  keep         -- this module's settings: blocks up to ``MMAP_THRESHOLD`` come from the heap, the heap
                  is trimmed only above ``TRIM_THRESHOLD``, and it grows ``TOP_PAD`` at a time.

Why: a training step allocates and frees the same activations and gradients every microbatch.  With
glibc's defaults, whether those frees go back to the kernel depends on the order of frees, and the
split backward (I now, W later: autosplit/weight_grad.py) holds output gradients across other
computes, which is the order that loses: one stage of the benchmark ViT took 20,000 page faults per
step with I + W against 1,300-2,800 with the fused backward, and F + I + W ran 6-8 % slower than F + B
(1-3 % with the settings here, where neither faults in the steady state: docs/benchmarks.md).  Activations
above 32 MiB (a ViT-B/16 MLP activation at batch 32 is 74 MiB) fault in every time with the defaults,
whatever the order.

Why ``mallopt`` and not jemalloc / tcmalloc (what torch's CPU performance guide recommends): those
need the job relaunched under ``LD_PRELOAD``; ``mallopt`` changes the running process, for every
allocation made afterwards.  The cost: up to ``TRIM_THRESHOLD`` of freed memory stays in the process
(its RSS stays near the step's peak), which a training process wants anyway.  GPU runs are not
touched (the CUDA caching allocator already keeps device memory).  ``AUTOSPLIT_HOST_MALLOC=0`` turns
it off.  The cost model's CPU measurements (profiling/measure_profile.py, cost_model/model_fit.py) run
under the same settings, so that they time what training runs.

Why here, at the top of the package, and not in autosplit/profiling with the measurements: training applies
it (runtime/parallelize.py), and the runtime never imports the profiling package; cost_model/model_fit.py
applies it too, and the cost model never imports the runtime.  It imports nothing of autosplit's.
"""
from __future__ import annotations

import ctypes
import logging
import os
import platform

log = logging.getLogger("autosplit")

ENV = "AUTOSPLIT_HOST_MALLOC"
MMAP_THRESHOLD = 256 * 2**20
TRIM_THRESHOLD = 2**30
TOP_PAD = 64 * 2**20
# glibc's <malloc.h> parameter numbers
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3
_applied = False


def keep_freed_host_memory() -> bool:
    """Apply the settings above to this process's glibc malloc, once; returns whether they are in effect.

    No effect (returns False) off glibc (macOS, musl), or when ``AUTOSPLIT_HOST_MALLOC=0``.
    """
    global _applied
    if _applied:
        return True
    if os.environ.get(ENV, "1") in ("0", "false", "False") or platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(None)
    # the mmap threshold first: setting any of the three ends glibc's dynamic adjustment of the others
    settings = ((_M_MMAP_THRESHOLD, MMAP_THRESHOLD), (_M_TRIM_THRESHOLD, TRIM_THRESHOLD), (_M_TOP_PAD, TOP_PAD))
    _applied = all(libc.mallopt(param, value) == 1 for param, value in settings)
    if _applied:
        log.info("host malloc: blocks up to %d MiB from the heap, trimmed above %d MiB (%s=0 turns this off)",
                 MMAP_THRESHOLD >> 20, TRIM_THRESHOLD >> 20, ENV)
    return _applied
