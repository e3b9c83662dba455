"""Writes the seed corpus of the safetensors_header fuzz target from the
malformed and valid cases of the Python tests (small files, committed)."""

import sys
from pathlib import Path

here = Path(__file__).resolve().parent
sys.path.insert(0, str(here.parent / "bindings" / "python" / "tests"))
from malformed_cases import CASES, VALID  # noqa: E402

out = here / "corpus" / "safetensors_header"
out.mkdir(parents=True, exist_ok=True)
for name, data, *_ in [*CASES, *VALID]:
    if len(data) <= 64 * 1024:
        (out / name).write_bytes(data)
print(f"{len(list(out.iterdir()))} files in {out}")
