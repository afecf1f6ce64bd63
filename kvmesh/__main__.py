"""`python -m kvmesh ...` runs the `kvmesh` command."""

from __future__ import annotations

import sys

from kvmesh.node.cli import main

sys.exit(main())
