"""Prepare the local Triton server in the git-ignored ``.triton/`` folder.

The ``nvidia-pytriton`` wheel ships tritonserver 2.51 with the Python backend and one
Python backend stub per Python version. This lays them out the way tritonserver wants:

    .triton/bin/tritonserver
    .triton/backends/python/{libtriton_python.so, triton_python_backend_utils.py,
                             triton_python_backend_stub}   <- stub for *this* Python
    .triton/backends/inflight -> ../../backend              (our Python-based backend)
    .triton/caches/local/...
    .triton/bin/perf_analyzer                               (a wrapper, see below)

Idempotent: files are re-copied only when missing or different in size/mtime, the
symlink is (re)made when it does not point at ``backend/``. Writes
``.triton/.inflight-setup`` when done (the Makefile's stamp).

Usage: ``python -m tools.setup_triton [--triton-dir DIR]``
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

from backend.paths import REPO_ROOT

DEFAULT_TRITON_DIR = REPO_ROOT / ".triton"
STAMP_NAME = ".inflight-setup"


def pytriton_server_dir() -> Path:
    """The ``pytriton/tritonserver`` folder of the installed nvidia-pytriton wheel."""
    import importlib.util

    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("nvidia-pytriton is not installed in this Python; run `make setup`")
    root = Path(list(spec.submodule_search_locations)[0]) / "tritonserver"
    if not (root / "bin" / "tritonserver").exists():
        raise SystemExit(f"no tritonserver binary under {root}")
    return root


def pytriton_libs_dir() -> Path:
    """The wheel's bundled shared libraries (``site-packages/nvidia_pytriton.libs``)."""
    return pytriton_server_dir().parent.parent / "nvidia_pytriton.libs"


def setup_perf_analyzer(triton_dir: Path) -> Path:
    """Write ``bin/perf_analyzer``: the project venv's perf_analyzer 2.51 with its libraries.

    The binary (from the ``tritonclient[all]`` wheel) needs ``libb64.so.0d`` and
    ``libcudart.so.12``, which a CPU-only Debian 12 machine lacks: nvidia-pytriton ships
    libb64 under a hashed name, the ``nvidia-cuda-runtime-cu12`` wheel ships libcudart.
    The wrapper puts a correctly named link and libcudart's folder on LD_LIBRARY_PATH.
    ``make perf`` runs it, and the genai-perf venv links its ``perf_analyzer`` to it.
    """
    import importlib.util
    import shlex

    binary = Path(sys.prefix) / "bin" / "perf_analyzer"
    if not binary.exists():
        raise SystemExit(f"{binary} is missing: tritonclient[all] ships it; run `make setup`")
    libb64 = sorted(pytriton_libs_dir().glob("libb64*.so*"))
    if not libb64:
        raise SystemExit(f"no libb64 in {pytriton_libs_dir()}")
    spec = importlib.util.find_spec("nvidia.cuda_runtime")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("nvidia-cuda-runtime-cu12 is not installed in this venv: run `make setup`")
    cudart_dir = Path(list(spec.submodule_search_locations)[0]) / "lib"

    lib_dir = triton_dir / "perf_analyzer_libs"
    lib_dir.mkdir(parents=True, exist_ok=True)
    link = lib_dir / "libb64.so.0d"
    if link.is_symlink() or link.exists():
        link.unlink()
    link.symlink_to(libb64[0])

    wrapper = triton_dir / "bin" / "perf_analyzer"
    wrapper.parent.mkdir(parents=True, exist_ok=True)
    lib_path = f"{lib_dir}:{cudart_dir}"
    wrapper.write_text(
        "#!/bin/sh\n"
        "# perf_analyzer 2.51 from the project venv, with the libraries it needs (tools/setup_triton.py).\n"
        f'LD_LIBRARY_PATH={shlex.quote(lib_path)}"${{LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}}" '
        f'exec {shlex.quote(str(binary))} "$@"\n'
    )
    wrapper.chmod(0o755)
    return wrapper


def _same_file(src: Path, dst: Path) -> bool:
    if not dst.exists() or dst.is_symlink():
        return False
    s, d = src.stat(), dst.stat()
    return s.st_size == d.st_size and int(s.st_mtime) == int(d.st_mtime)


def _sync_tree(src: Path, dst: Path) -> int:
    """Copy ``src`` into ``dst`` (files that differ only); returns the number copied."""
    copied = 0
    for path in src.rglob("*"):
        if "__pycache__" in path.parts:
            continue
        target = dst / path.relative_to(src)
        if path.is_dir():
            target.mkdir(parents=True, exist_ok=True)
            continue
        if _same_file(path, target):
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        if target.is_symlink() or target.exists():
            target.unlink()
        shutil.copy2(path, target)
        copied += 1
    return copied


def setup_triton(triton_dir: Path = DEFAULT_TRITON_DIR, backend_dir: Path = REPO_ROOT / "backend") -> Path:
    server = pytriton_server_dir()
    triton_dir.mkdir(parents=True, exist_ok=True)
    copied = 0
    for part in ("bin", "backends", "caches"):
        copied += _sync_tree(server / part, triton_dir / part)

    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = server / "python_backend_stubs" / version / "triton_python_backend_stub"
    if not stub.exists():
        raise SystemExit(f"nvidia-pytriton ships no Python backend stub for Python {version}")
    stub_dst = triton_dir / "backends" / "python" / "triton_python_backend_stub"
    if not _same_file(stub, stub_dst):
        if stub_dst.exists() or stub_dst.is_symlink():
            stub_dst.unlink()
        shutil.copy2(stub, stub_dst)
        copied += 1
    for exe in (triton_dir / "bin" / "tritonserver", stub_dst):
        exe.chmod(exe.stat().st_mode | 0o111)

    link = triton_dir / "backends" / "inflight"
    target = os.path.relpath(backend_dir, link.parent)
    if not (link.is_symlink() and os.readlink(link) == target):
        if link.is_symlink() or link.is_file():
            link.unlink()
        elif link.exists():
            shutil.rmtree(link)
        link.symlink_to(target, target_is_directory=True)
        copied += 1

    setup_perf_analyzer(triton_dir)

    (triton_dir / STAMP_NAME).write_text(f"python {version}\nfrom {server}\n")
    state = f"updated {copied} item(s)" if copied else "already up to date"
    print(f"setup_triton: {triton_dir} {state} (tritonserver from {server}, stub for Python {version})")
    return triton_dir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--triton-dir", type=Path, default=DEFAULT_TRITON_DIR)
    args = parser.parse_args(argv)
    setup_triton(args.triton_dir.resolve())
    return 0


if __name__ == "__main__":
    sys.exit(main())
