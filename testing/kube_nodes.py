"""The fake nodes a test cluster registers (KWOK keeps them Ready): labelled pools, GPU and RDMA
capacity, the GPU taint, and the loopback addresses KWOK gives nodes and pods.

GPU nodes carry the taint `nvidia.com/gpu=present:NoSchedule` (as GPU clusters
usually do): workloads meant for them must tolerate it (see GPU_TOLERATION).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

POOL_LABEL = "tandem.dev/pool"
KWOK_ANNOTATION = "kwok.x-k8s.io/node"
GPU_TAINT = {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}
# What a pod spec needs to land on the GPU pools.
GPU_TOLERATION = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}

GPU_RESOURCES = {
    "nvidia.com/gpu": "8",
    "rdma/ib": "4",
    "rdma/rdma_shared_device_a": "4",
}
BASE_RESOURCES = {"cpu": "64", "memory": "512Gi", "pods": "110", "ephemeral-storage": "1Ti"}

# KWOK gives pods IPs from a loopback /16 (first one 127.<n>.0.2) and nodes this InternalIP. Each
# cluster draws its own <n>: test sessions running side by side on one machine (each binding real
# processes to its pods' IPs) would otherwise hand out, and bind, the same addresses.
POD_CIDR_OCTETS = range(50, 250)  # Cluster.pod_cidr: 127.<one of these>.0.1/16
NODE_IP = "127.49.0.1"


@dataclass(frozen=True)
class NodeSpec:
    """One fake node: its name, pool and whether it has GPUs (and so the GPU taint)."""

    name: str
    pool: str
    gpus: bool = True

    def manifest(self) -> dict[str, Any]:
        """The Node object KWOK takes over; capacity is set at creation like a kubelet would."""
        resources = dict(BASE_RESOURCES)
        if self.gpus:
            resources.update(GPU_RESOURCES)
        labels = {
            "kubernetes.io/hostname": self.name,
            "kubernetes.io/os": "linux",
            "kubernetes.io/arch": "amd64",
            "type": "kwok",
            POOL_LABEL: self.pool,
        }
        if self.gpus:
            labels["nvidia.com/gpu.present"] = "true"
        return {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {
                "name": self.name,
                "labels": labels,
                "annotations": {KWOK_ANNOTATION: "fake", "node.alpha.kubernetes.io/ttl": "0"},
            },
            "spec": {"taints": [dict(GPU_TAINT)] if self.gpus else []},
            "status": {"capacity": resources, "allocatable": resources},
        }


DEFAULT_NODES: tuple[NodeSpec, ...] = (
    NodeSpec("prefill-0", "prefill"),
    NodeSpec("prefill-1", "prefill"),
    NodeSpec("decode-0", "decode"),
    NodeSpec("decode-1", "decode"),
    NodeSpec("cpu-0", "cpu", gpus=False),
)

