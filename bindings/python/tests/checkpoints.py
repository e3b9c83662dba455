"""Copies of a test checkpoint and the sums files beside them, shared by
the stream and collective tests."""

from __future__ import annotations

import hashlib
from pathlib import Path


def copy_model(model: Path, to: Path) -> Path:
    """A copy of every file of ``model`` in the new directory ``to``."""
    to.mkdir()
    for p in model.iterdir():
        (to / p.name).write_bytes(p.read_bytes())
    return to


def write_sums(directory: Path) -> None:
    """SHA256SUMS of the directory's shards, as ``sha256sum *.safetensors``
    writes it."""
    lines = [f"{hashlib.sha256(p.read_bytes()).hexdigest()}  {p.name}\n" for p in sorted(directory.glob("*.safetensors"))]
    (directory / "SHA256SUMS").write_text("".join(lines))
