"""node.Node at start: kv_share gets the threshold fitted to the engine's context, and a dead one is named in the log."""

from __future__ import annotations

import pytest

from kvmesh.node.config import REPLICATE_MIN_TOKENS, NodeConfig
from kvmesh.node.node import Node


def _node(**kvshare: object) -> Node:
    cfg = NodeConfig.model_validate({"engine": {"kind": "sim", "cache_bytes": 8 << 20, "sim": {"kv_scale": 0.01}},
                                     "kvshare": {"fsync": "never", **kvshare}})
    return Node(cfg)


def test_a_threshold_that_can_never_fire_is_named_at_start(caplog: pytest.LogCaptureFixture) -> None:
    """replicate_min_tokens at or past the engine's context per slot: the node starts, and warns that nothing will replicate."""
    with caplog.at_level("WARNING", logger="kvmesh.node"):
        node = _node(replicate_min_tokens=1 << 30)
    try:
        assert node.stats()["replicate_min_tokens"] == 1 << 30
        assert any("no session will ever be replicated" in r.message for r in caplog.records)
    finally:
        node.engine.close()


def test_an_unset_threshold_is_fitted_to_the_context(caplog: pytest.LogCaptureFixture) -> None:
    """Unset, the node's threshold is min(REPLICATE_MIN_TOKENS, context / 4), and nothing is warned of."""
    with caplog.at_level("WARNING", logger="kvmesh.node"):
        node = _node()
    try:
        stats = node.stats()
        assert stats["replicate_min_tokens"] == min(REPLICATE_MIN_TOKENS, stats["max_context"] // 4)
        assert not [r for r in caplog.records if "replicated" in r.message]
    finally:
        node.engine.close()


def test_the_configured_zone_is_in_what_the_node_reports_of_itself() -> None:
    """mesh.zone reaches HostInfo (the cluster view the console groups hosts by)."""
    cfg = NodeConfig.model_validate({"engine": {"kind": "sim", "cache_bytes": 8 << 20, "sim": {"kv_scale": 0.01}},
                                     "kvshare": {"fsync": "never"}, "mesh": {"zone": "rack-a"}})
    node = Node(cfg)
    try:
        assert node.host_info().zone == "rack-a"
    finally:
        node.engine.close()
