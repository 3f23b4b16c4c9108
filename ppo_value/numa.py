"""Bind a GPU worker's CPU threads to the NUMA node of its GPU.

On a multi-socket GPU node each GPU hangs off one CPU socket. A worker whose threads run on the
other socket pays the inter-socket link on every host-device copy and data-loader step, and its
first-touch host allocations land in the wrong memory. NeMo-RL's workers bind to the GPU's
NUMA node for that reason; this does the same with the kernel's own topology files:

- ``/sys/bus/pci/devices/<pci address>/numa_node``: the GPU's node (``-1``: no NUMA info);
- ``/sys/devices/system/node/node<N>/cpulist``: that node's CPUs (``0-15,32-47``);

then ``os.sched_setaffinity(0, cpus)``, restricted to the CPUs this process may use (a
container or job scheduler may allow fewer). On CPU devices, machines without NUMA
information, or where the intersection is empty, it changes nothing.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

log = logging.getLogger(__name__)

__all__ = ["bind_to_gpu_numa_node", "gpu_pci_address", "numa_node_cpus", "pci_numa_node"]


def parse_cpulist(text: str) -> set[int]:
    """CPUs of a kernel cpulist such as ``"0-3,8,10-11"``.

    Raises:
        ValueError: on a malformed list.
    """
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        lo, sep, hi = part.partition("-")
        if sep:
            cpus.update(range(int(lo), int(hi) + 1))
        else:
            cpus.add(int(lo))
    return cpus


def gpu_pci_address(index: int) -> str:
    """The PCI address (``"0000:3b:00.0"``, lower case) of CUDA device ``index``, from
    ``torch.cuda.get_device_properties``."""
    props = torch.cuda.get_device_properties(index)
    return f"{props.pci_domain_id:04x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0"


def pci_numa_node(pci_address: str, sysfs_root: str | Path = "/sys") -> int | None:
    """The NUMA node of a PCI device, or ``None`` if the kernel reports none (``-1``/absent)."""
    path = Path(sysfs_root) / "bus" / "pci" / "devices" / pci_address.lower() / "numa_node"
    try:
        node = int(path.read_text().strip())
    except FileNotFoundError:
        return None
    return node if node >= 0 else None


def numa_node_cpus(node: int, sysfs_root: str | Path = "/sys") -> set[int]:
    """CPUs of NUMA ``node`` (empty if the node is unknown)."""
    path = Path(sysfs_root) / "devices" / "system" / "node" / f"node{node}" / "cpulist"
    try:
        return parse_cpulist(path.read_text())
    except FileNotFoundError:
        return set()


def bind_to_gpu_numa_node(
    device: torch.device,
    *,
    sysfs_root: str | Path = "/sys",
    pci_address: str | None = None,
) -> set[int] | None:
    """Pin this process to the CPUs of ``device``'s NUMA node.

    Args:
        device: the worker's device; anything but ``cuda`` is a no-op.
        sysfs_root: root of the sysfs tree (a fake topology in tests).
        pci_address: the GPU's PCI address; default from :func:`gpu_pci_address`.

    Returns:
        The CPU set now in effect, or ``None`` if nothing was changed (CPU device, no NUMA
        information, or no allowed CPU on that node).
    """
    if device.type != "cuda":
        return None
    address = pci_address or gpu_pci_address(
        device.index if device.index is not None else torch.cuda.current_device()
    )
    node = pci_numa_node(address, sysfs_root)
    if node is None:
        log.info("GPU %s: no NUMA node reported; CPU affinity left as is", address)
        return None
    allowed = os.sched_getaffinity(0)
    cpus = numa_node_cpus(node, sysfs_root) & allowed
    if not cpus:
        log.warning(
            "GPU %s is on NUMA node %d, none of whose CPUs this process may use; not binding",
            address,
            node,
        )
        return None
    os.sched_setaffinity(0, cpus)
    log.info("GPU %s on NUMA node %d: bound to %d CPUs", address, node, len(cpus))
    return cpus
