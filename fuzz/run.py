"""Coverage-guided fuzzing (atheris, libFuzzer) of one target of ``fuzz/targets.py``.

    python fuzz/run.py ingest fuzz/corpus/ingest -max_total_time=60
    python fuzz/run.py request fuzz/corpus/request -max_total_time=60
    python fuzz/run.py control fuzz/corpus/control -max_total_time=60

The corpus folder is read first and new interesting inputs are written into it; commit what
it adds. Arguments after the target name go to libFuzzer (``-help=1`` lists them).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import atheris  # noqa: E402

with atheris.instrument_imports():
    from fuzz.targets import TARGETS  # noqa: E402


def main() -> None:
    if len(sys.argv) < 2 or sys.argv[1] not in TARGETS:
        sys.exit(f"usage: run.py {{{','.join(TARGETS)}}} [CORPUS_DIR] [libFuzzer flags]")
    target = TARGETS[sys.argv[1]]
    atheris.Setup([sys.argv[0], *sys.argv[2:]], target)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
