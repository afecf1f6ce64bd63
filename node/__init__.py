"""kvmesh.node: the agent that runs on every inference host (engine, kv_share, mesh, API)."""
