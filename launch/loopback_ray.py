"""A Ray cluster of several nodes on this machine, all on loopback (`ray.cluster_utils.Cluster`).

The tests and `experiment failover --cluster ray` run a fabric on it, and remove nodes from it.

Every raylet is a node of its own, with its own worker processes, resources and failure. That is
all a node's death needs. The head node takes no fabric process. It is the driver's node and holds
Ray's control store, so its death is the whole cluster's. Node failure detection is tightened: a
dead raylet is declared dead in ~1.5 s instead of ~15 s. A production cluster sets the same knobs
in its head's `--system-config`.
"""

from __future__ import annotations

import os
from typing import Any


def keep_ray_on_loopback() -> None:
    """Keeps Ray off this machine's primary address, which it advertises unless told not to.

    Ray reads the switch once, when it is first imported. It is set here for the raylets Ray starts,
    and for this process if Ray is already imported."""
    import sys

    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    constants = sys.modules.get("ray._private.ray_constants")
    if constants is not None:
        constants.ENABLE_RAY_CLUSTER = False  # type: ignore[attr-defined]


keep_ray_on_loopback()

HEALTH_CHECKS = {"health_check_period_ms": 300, "health_check_failure_threshold": 3, "health_check_timeout_ms": 300}


class LoopbackRay:
    def __init__(self, nodes: int = 3, resources: dict[str, float] | None = None) -> None:
        from ray.cluster_utils import Cluster

        self.cluster = Cluster(initialize_head=True, head_node_args={
            "node_ip_address": "127.0.0.1", "num_cpus": 0, "include_dashboard": False,
            "_system_config": HEALTH_CHECKS})
        self.nodes: dict[str, Any] = {}  # node id -> ray's node handle
        try:
            for _ in range(nodes):
                self.add_node(resources)
            self.cluster.wait_for_nodes()
        except BaseException:
            self.shutdown()
            raise

    @property
    def address(self) -> str:
        return str(self.cluster.address)

    def add_node(self, resources: dict[str, float] | None = None) -> str:
        node = self.cluster.add_node(node_ip_address="127.0.0.1", num_cpus=0, resources=resources or {"fabric": 64})
        self.nodes[node.node_id] = node
        return str(node.node_id)

    def remove_node(self, node_id: str) -> None:
        """Kills the node at once: its raylet and every process of it get SIGKILL."""
        self.cluster.remove_node(self.nodes.pop(node_id), allow_graceful=False)

    def shutdown(self) -> None:
        import ray

        if ray.is_initialized():  # a driver in this process
            ray.shutdown()
        self.cluster.shutdown()
