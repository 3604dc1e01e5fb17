"""A rank's peak memory over a stretch of work: the device's allocator on CUDA, the process's resident set on CPU.

Terms:
  peak (CUDA) -- ``torch.cuda.max_memory_allocated`` since the window opened (the counter is reset
                 then): the bytes of live tensors at the worst moment, what the plan's predicted
                 memory counts (parameters, gradients, optimizer moments, kept activations).
  peak (CPU)  -- the resident set's high-water mark (``VmHWM``, reset by writing 5 to
                 ``/proc/self/clear_refs``) minus the resident set when the window opened: what the
                 work added, but also allocator slack and freed memory kept for reuse
                 (autosplit/host_memory.py), so it reads high.  None where /proc cannot tell (not Linux).
"""
from __future__ import annotations

import torch


def _status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


class PeakMemory:
    """``start()`` opens the window, ``peak()`` reads the bytes (see the module docstring) or None."""

    def __init__(self, device: torch.device):
        self.device, self.base = device, 0

    @property
    def kind(self) -> str:
        return "allocated" if self.device.type == "cuda" else "resident growth"

    def start(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            return
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            pass
        self.base = (_status_kib("VmRSS") or 0) * 1024

    def peak(self) -> int | None:
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device)
        hwm = _status_kib("VmHWM")
        return None if hwm is None else max(0, hwm * 1024 - self.base)
