"""`python -m kvmesh.console` runs the console (same as `kvmesh-console`)."""

from __future__ import annotations

import sys

from kvmesh.console.cli import main

sys.exit(main())
