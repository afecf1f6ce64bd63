"""The wire contract: every model that crosses a process boundary, versioned.

The console and any third-party consumer import this module and nothing else
from `node`. It depends on pydantic only.
"""

from __future__ import annotations

import re

PROTOCOL_VERSION = 1

# Session ids name files on disk, so they are held to a safe alphabet and length.
SESSION_ID_RE = re.compile(r"[A-Za-z0-9._:@-]{1,128}")


def is_valid_session_id(value: str) -> bool:
    return bool(SESSION_ID_RE.fullmatch(value)) and value not in (".", "..")
