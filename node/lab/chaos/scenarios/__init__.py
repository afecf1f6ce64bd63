"""The drills' scenarios, in the order `kvmesh chaos` runs them.

transfer: a node killed mid-transfer, a connection cut, a bit flipped (kv_share faults);
hosts: a full disk, a frozen peer, every cache evicted, a restart with replicas on disk;
clock: one host's wall clock jumps.
"""

from __future__ import annotations

from kvmesh.node.lab.chaos.scenarios import clock, hosts, transfer
from kvmesh.node.lab.chaos.scenarios.base import Scenario

SCENARIOS: list[Scenario] = [*transfer.SCENARIOS, *hosts.SCENARIOS, *clock.SCENARIOS]

__all__ = ["SCENARIOS", "Scenario"]
