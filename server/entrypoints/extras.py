"""Which extra each `iterserve` command needs, and what of it is not installed (for a clear message)."""

from __future__ import annotations

import re
from importlib import metadata

COMMAND_EXTRAS = {"generate": "server", "serve": "server", "bench": "bench", "operator": "operator",
                  "router": "router"}


def missing(extra: str) -> list[str]:
    """The distributions `iterserve[extra]` requires that are not installed.

    Empty where iterserve's own metadata is absent (the sources on PYTHONPATH, as on the GPU benchmark's
    machines): then nothing is known, and a missing module fails at its import as usual.
    """
    try:
        requires = metadata.requires("iterserve") or []
    except metadata.PackageNotFoundError:
        return []
    absent = []
    for line in requires:
        requirement, _, marker = line.partition(";")
        if not re.search(rf"""extra\s*==\s*["']{re.escape(extra)}["']""", marker):
            continue
        match = re.match(r"[A-Za-z0-9._-]+", requirement.strip())
        if match is None:  # not a requirement line
            continue
        name = match.group(0)
        try:
            metadata.distribution(name)
        except metadata.PackageNotFoundError:
            absent.append(name)
    return absent
