"""kvmesh-console: the Textual operator console of a kvmesh mesh.

Imports from `node` are limited to `node.protocol` (the wire contract).
"""
