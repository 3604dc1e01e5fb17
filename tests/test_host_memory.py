"""autosplit/host_memory.py: with the settings, a freed 48 MiB activation's pages stay in the process
(after a few steps of heap growth), where glibc's default maps and faults them in every time."""
import os
import platform
import subprocess
import sys

import pytest

SCRIPT = r"""
import resource, sys, torch
from autosplit.host_memory import keep_freed_host_memory
applied = keep_freed_host_memory()
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):  # warm-up: the heap grows (aligned requests do not fit the freed block at first)
    torch.empty(12 * 2**20).fill_(1.0)       # 48 MiB, allocated, touched and freed
before = faults()
for _ in range(10):                          # what every microbatch does with its activations
    torch.empty(12 * 2**20).fill_(1.0)
print(applied, (faults() - before) // 10)
"""


def _faults_per_allocation(enabled: bool) -> tuple[bool, int]:
    env = dict(os.environ, AUTOSPLIT_HOST_MALLOC="1" if enabled else "0", OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, check=True)
    applied, faults = out.stdout.split()
    return applied == "True", int(faults)


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt settings exist only in glibc")
@pytest.mark.slow
def test_freed_activation_memory_is_reused_without_page_faults():
    applied, faults = _faults_per_allocation(enabled=False)
    # glibc's default: above 32 MiB every allocation is a fresh mmap, each of its 12,288 pages faults in
    assert not applied and faults > 10_000, faults
    applied, faults = _faults_per_allocation(enabled=True)
    assert applied and faults < 100, faults
