"""Makes `perf_analyzer` runnable from a genai-perf venv (`make genai-perf-setup` runs this
with the project's Python once genai-perf is installed there).

genai-perf runs `perf_analyzer` from PATH. `make setup` writes `.triton/bin/perf_analyzer`,
a wrapper that runs the project venv's perf_analyzer 2.51 with the libraries it needs
(tools/setup_triton.py); this links the genai-perf venv's `bin/perf_analyzer` to it, so
that running the venv's `genai-perf` with its `bin` first on PATH is all it takes.

    .venv/bin/python tests/e2e/genai_perf_setup.py .venv-genai
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from backend.paths import REPO_ROOT

PERF_ANALYZER = REPO_ROOT / ".triton" / "bin" / "perf_analyzer"


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    if not PERF_ANALYZER.exists():
        raise SystemExit(f"{PERF_ANALYZER} is missing: run `make setup`")
    link = Path(argv[0]).resolve() / "bin" / "perf_analyzer"
    if link.is_symlink() or link.exists():
        link.unlink()
    link.symlink_to(PERF_ANALYZER)
    version = subprocess.run([str(link), "--version"], capture_output=True, text=True, timeout=60)
    if version.returncode != 0 or "2.51" not in version.stdout + version.stderr:
        raise SystemExit(f"{link} does not run: {version.stdout}{version.stderr}")
    print(f"{link}: {(version.stdout + version.stderr).strip()}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
