"""Makes `perf_analyzer` runnable from a genai-perf venv (`make genai-perf-setup` runs this
with the project's Python once genai-perf is installed there).

genai-perf runs `perf_analyzer` from PATH. The binary comes from the project venv's
`tritonclient[all]==2.51.0` wheel and needs `libb64.so.0d` and `libcudart.so.12`, which
a CPU-only Debian 12 machine does not have (DESIGN.md, "Known pitfalls"): the wheel of
nvidia-pytriton ships libb64 under a hashed name, and the `nvidia-cuda-runtime-cu12`
wheel ships libcudart. This writes, inside the genai-perf venv,

- `lib/perf_analyzer/libb64.so.0d`: a link to pytriton's copy;
- `bin/perf_analyzer`: a wrapper that puts that folder and libcudart's on
  LD_LIBRARY_PATH and runs the project venv's binary,

so that running the venv's `genai-perf` with its `bin` first on PATH is all it takes.

    .venv/bin/python tests/genai_perf_setup.py .venv-genai
"""

from __future__ import annotations

import importlib.util
import shlex
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from tools.serve import pytriton_libs_dir  # noqa: E402


def cuda_runtime_lib_dir() -> Path:
    spec = importlib.util.find_spec("nvidia.cuda_runtime")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("nvidia-cuda-runtime-cu12 is not installed in this venv: run `make setup`")
    lib = Path(list(spec.submodule_search_locations)[0]) / "lib"
    if not any(lib.glob("libcudart.so.12*")):
        raise SystemExit(f"no libcudart.so.12 in {lib}")
    return lib


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    genai_venv = Path(argv[0]).resolve()
    binary = Path(sys.prefix) / "bin" / "perf_analyzer"
    if not binary.exists():
        raise SystemExit(f"{binary} is missing: tritonclient[all] ships it; run `make setup`")
    pytriton_libs = pytriton_libs_dir()
    libb64 = sorted(pytriton_libs.glob("libb64*.so*")) if pytriton_libs else []
    if not libb64:
        raise SystemExit("no libb64 in nvidia_pytriton.libs: run `make setup`")

    lib_dir = genai_venv / "lib" / "perf_analyzer"
    lib_dir.mkdir(parents=True, exist_ok=True)
    link = lib_dir / "libb64.so.0d"
    if link.is_symlink() or link.exists():
        link.unlink()
    link.symlink_to(libb64[0])

    wrapper = genai_venv / "bin" / "perf_analyzer"
    lib_path = f"{lib_dir}:{cuda_runtime_lib_dir()}"
    wrapper.write_text(
        "#!/bin/sh\n"
        "# perf_analyzer 2.51 from the project venv, with the libraries it needs (tests/genai_perf_setup.py).\n"
        f'LD_LIBRARY_PATH={shlex.quote(lib_path)}"${{LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}}" '
        f'exec {shlex.quote(str(binary))} "$@"\n'
    )
    wrapper.chmod(0o755)
    version = subprocess.run([str(wrapper), "--version"], capture_output=True, text=True, timeout=60)
    if version.returncode != 0 or "2.51" not in version.stdout + version.stderr:
        raise SystemExit(f"{wrapper} does not run: {version.stdout}{version.stderr}")
    print(f"{wrapper}: {(version.stdout + version.stderr).strip()}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
