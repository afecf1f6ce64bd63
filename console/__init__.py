"""kvmesh-console: the Textual operator console of a kvmesh mesh.

Imports from `kvmesh.node` are limited to `kvmesh.node.protocol` (the wire contract).
"""
