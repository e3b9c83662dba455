"""``python -m dmaload``: the dmaload command line.

If the native ``dmaload`` CLI (built from ``crates/dmaload-cli``) is found,
it is executed with the same arguments, so every subcommand (``load``,
``info``, ``demo``, ...) behaves exactly as documented for it. (The
benchmarks are the separate ``dmaload-bench`` binary; ``bench`` says so.) It is
looked for in ``$DMALOAD_CLI``, next to the Python executable (a virtual
environment's ``bin``), then on ``PATH``; only an ELF executable is taken,
never a script (which could be this module again).

Without it (a wheel installed alone), a Python implementation over the
native module runs instead: ``load`` (the main options, text or ``--json``)
and ``tensors`` (list a safetensors file's tensors). ``DMALOAD_PYTHON_CLI=1``
forces it.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

from ._cli import PYTHON_ONLY, main


def native_cli() -> str | None:
    """Path of the native dmaload executable, or None."""
    candidates = [os.environ.get("DMALOAD_CLI"), str(Path(sys.executable).parent / "dmaload"), shutil.which("dmaload")]
    for candidate in candidates:
        if not candidate or not os.access(candidate, os.X_OK) or not os.path.isfile(candidate):
            continue
        try:
            with open(candidate, "rb") as f:
                if f.read(4) == b"\x7fELF":
                    return candidate
        except OSError:
            continue
    return None


def run(argv: list[str]) -> int:
    if os.environ.get("DMALOAD_PYTHON_CLI") != "1" and not (argv and argv[0] in PYTHON_ONLY):
        cli = native_cli()
        if cli is not None:
            sys.stdout.flush()
            os.execv(cli, [cli, *argv])
    return main(argv)


if __name__ == "__main__":
    sys.exit(run(sys.argv[1:]))
