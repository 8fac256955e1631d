"""Block device names from device numbers and paths (/sys/dev/block, /sys/class/block)."""

from __future__ import annotations

import os
from pathlib import Path


def device_name(major: int, minor: int) -> str:
    """Kernel name of a block device number (``vda``), or ``major:minor`` when /sys does not know it."""
    link = Path(f"/sys/dev/block/{major}:{minor}")
    try:
        return os.path.basename(os.readlink(link))
    except OSError:
        return f"{major}:{minor}"


def device_for_path(path: str | os.PathLike[str]) -> str:
    """Whole-disk block device backing ``path`` (via its st_dev and /sys/class/block)."""
    dev = os.stat(path).st_dev
    name = device_name(os.major(dev), os.minor(dev))
    real = os.path.realpath(f"/sys/class/block/{name}")
    if os.path.exists(os.path.join(real, "partition")):
        name = os.path.basename(os.path.dirname(real))
    return name
