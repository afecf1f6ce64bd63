"""kvmesh: keep long LLM conversations warm across a mesh of inference hosts.

The code lives at the repository's top level (`node/`, `console/`) and is installed
under this package as `kvmesh.node` and `kvmesh.console`, so that PyPI's own `node`
and `console` packages can sit beside it. In a checkout, `kvmesh/node` and
`kvmesh/console` are links to those folders; a wheel carries real copies.
"""

from __future__ import annotations

__version__ = "0.1.0"
