"""kind "vllm": kvmesh over a vLLM server process (engine.py), with kvmesh's KV connector inside vLLM
(connector.py) sharing the host's block pool (layout.py, pool.py).

Nothing is imported here: vLLM's process imports this package (as `kvmesh_vllm`) for the connector,
with no kvmesh installed beside it.
"""
