"""NUMA binding of GPU workers on a faked sysfs topology (and a no-op on CPU)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from ppo_value.numa import bind_to_gpu_numa_node, parse_cpulist, pci_numa_node


@pytest.fixture
def restore_affinity() -> Iterator[set[int]]:
    before = os.sched_getaffinity(0)
    yield before
    os.sched_setaffinity(0, before)


def fake_topology(root: Path, gpus: dict[str, int], nodes: dict[int, str]) -> Path:
    """``gpus``: PCI address -> NUMA node; ``nodes``: node -> cpulist text."""
    for address, node in gpus.items():
        d = root / "bus" / "pci" / "devices" / address
        d.mkdir(parents=True)
        (d / "numa_node").write_text(f"{node}\n")
    for node, cpulist in nodes.items():
        d = root / "devices" / "system" / "node" / f"node{node}"
        d.mkdir(parents=True)
        (d / "cpulist").write_text(cpulist + "\n")
    return root


def test_parse_cpulist() -> None:
    assert parse_cpulist("0-3,8,10-11\n") == {0, 1, 2, 3, 8, 10, 11}
    assert parse_cpulist("") == set()


def test_binds_to_the_gpus_node(tmp_path: Path, restore_affinity: set[int]) -> None:
    allowed = sorted(restore_affinity)
    target = allowed[-1]
    # GPU 1 on node 1 whose CPUs are {target} plus one this process may not use
    root = fake_topology(
        tmp_path,
        {"0000:1a:00.0": 0, "0000:3b:00.0": 1},
        {0: ",".join(map(str, allowed[:-1])) or "9999", 1: f"{target},{max(allowed) + 64}"},
    )
    got = bind_to_gpu_numa_node(
        torch.device("cuda", 1), sysfs_root=root, pci_address="0000:3B:00.0"
    )
    assert got == {target}
    assert os.sched_getaffinity(0) == {target}


def test_no_op_cases(tmp_path: Path, restore_affinity: set[int]) -> None:
    root = fake_topology(
        tmp_path, {"0000:01:00.0": -1, "0000:02:00.0": 0}, {0: str(max(restore_affinity) + 64)}
    )
    assert bind_to_gpu_numa_node(torch.device("cpu"), sysfs_root=root) is None
    cuda = torch.device("cuda", 0)
    assert bind_to_gpu_numa_node(cuda, sysfs_root=root, pci_address="0000:01:00.0") is None
    assert bind_to_gpu_numa_node(cuda, sysfs_root=root, pci_address="0000:09:00.0") is None
    # node 0 has only CPUs this process may not use: left alone rather than bound to nothing
    assert bind_to_gpu_numa_node(cuda, sysfs_root=root, pci_address="0000:02:00.0") is None
    assert pci_numa_node("0000:01:00.0", root) is None
    assert os.sched_getaffinity(0) == restore_affinity
