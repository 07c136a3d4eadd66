"""Pinning each local worker process to CPU cores of its own (``launcher.cpu_cores_per_rank``).

A host-bound step (an MoE step launches about 4,600 kernels, and its GPU waits on the launch rate)
runs as fast as its Python thread is fed, and on a node of several NUMA nodes that thread is best
next to its GPU. Pinned, each local rank gets ``cpu_cores_per_rank`` cores of its own: first the
cores next to its GPU (the PCI device's ``local_cpulist``), then the rest of what this process may
use. On the one-socket H200 machine of docs/speed.md it did not make MoE step times repeatable, and
one core a rank made the step 1.4-1.8x slower (the step's other threads take that core).
"""

from __future__ import annotations

import os
from pathlib import Path


def parse_cpulist(text: str) -> list[int]:
    """``"0-3,8,10-11"`` (Linux's cpulist format) as a list of core numbers."""
    cores: list[int] = []
    for part in text.strip().split(","):
        if not part:
            continue
        low, _, high = part.partition("-")
        cores.extend(range(int(low), int(high or low) + 1))
    return cores


def gpu_local_cores(local_rank: int) -> list[int]:
    """The cores on the NUMA node of this rank's GPU (from sysfs), or [] when unknown."""
    try:
        import torch

        if not torch.cuda.is_available():
            return []
        props = torch.cuda.get_device_properties(local_rank)
        bus = f"{props.pci_domain_id:04x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0"
        return parse_cpulist(Path(f"/sys/bus/pci/devices/{bus}/local_cpulist").read_text())
    except (OSError, ValueError, AttributeError, RuntimeError):
        return []


def rank_cores(per_rank: int, local_rank: int, allowed: list[int], near: list[int]) -> list[int]:
    """The ``per_rank`` cores of ``local_rank``: consecutive blocks of ``allowed``, the ones ``near`` its
    GPU first. Raises ValueError when the local ranks need more cores than ``allowed`` has."""
    order = [c for c in near if c in allowed] + [c for c in sorted(allowed) if c not in near]
    start = local_rank * per_rank
    if start + per_rank > len(order):
        raise ValueError(f"{per_rank} cores for local rank {local_rank} need {start + per_rank} cores, "
                         f"and this process may use {len(order)}")
    return order[start:start + per_rank]


def pin_worker(per_rank: int | None) -> list[int] | None:
    """Pin this worker process (and the threads it starts from now on) to its cores; returns them, or
    None when ``per_rank`` is None (unpinned)."""
    if not per_rank:
        return None
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    allowed = sorted(os.sched_getaffinity(0))
    cores = rank_cores(per_rank, local_rank, allowed, gpu_local_cores(local_rank))
    os.sched_setaffinity(0, cores)
    return cores


def usable_cores() -> int:
    """How many cores this process may run on (its affinity mask, not the machine's count)."""
    return len(os.sched_getaffinity(0))
