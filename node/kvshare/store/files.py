"""The replica store's file primitives: temp names, write-then-rename, directory fsync.

Every file the store writes starts under a temporary name (starting with `TEMP_PREFIX`,
which a session key cannot) and is renamed once complete, so no reader ever sees a
partial file; whatever still has a temp name at start is a leftover of a crash.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import uuid
from pathlib import Path
from typing import cast

import numpy as np

TEMP_PREFIX = "~"


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def temp_name(what: str) -> str:
    return f"{TEMP_PREFIX}{what}.{uuid.uuid4().hex}.tmp"


def unlink_quietly(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        path.unlink()


def write_file(directory: Path, name: str, data: bytes | memoryview, fsync: bool) -> None:
    """Write `data` as `name` in `directory`: temp file, fsync (optional), rename."""
    tmp = directory / temp_name(name)
    try:
        with open(tmp, "xb") as f:
            f.write(data)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, directory / name)
    except BaseException:
        unlink_quietly(tmp)
        raise


def remove_tree(root: Path, path: Path) -> None:
    """Make the directory vanish at once (rename to a temp name under `root`), then delete it."""
    trash = root / temp_name("trash")
    try:
        os.rename(path, trash)
    except FileNotFoundError:
        return
    shutil.rmtree(trash, ignore_errors=True)


def bytes_of(data: bytes | bytearray | memoryview | np.ndarray) -> memoryview:
    mv = memoryview(cast("bytes", data))  # numpy arrays are buffers too; the stubs disagree
    return mv if mv.format == "B" and mv.ndim == 1 else mv.cast("B")
