"""The lab: what tests, measures and demonstrates the mesh, apart from the agent that runs it.

`workload` (the coding-agent conversations every part below draws from) sits at the bottom;
`load` and `launcher` drive real node processes with it; `bench`, `chaos`, `netlab`, `soak` and
`demo` are the `kvmesh` commands of the same names, built on those. The agent's runtime (engine,
kvshare, mesh, api, protocol, events, config, node, server) never imports this package:
`kvmesh.node.cli` is the one entry point that reaches it, lazily (tests/lab/test_lab_apart.py).
"""
