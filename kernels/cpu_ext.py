"""The C++ CPU kernels (kernels/cpu/*.cpp), compiled once per machine and loaded.

torch's extension builder compiles them with g++ and ninja into `.build/cpu_kernels/`
(git-ignored) on first use; `make setup` does it ahead of time (`build()`), so neither a test nor the
Triton backend's first request waits for the compiler. `-march=native`: the build runs on
the machine that serves, and the kernels' inner loops are what the vector units are for;
no errno, reassociation and finite math let g++ vectorise expf (glibc's libmvec) and the
reductions: softmax's scalar expf was decode attention's largest cost (layer_ops.cpp opts
out: it matches the torch references' roundings). Compile flags only:
linked without -ffast-math, the module never changes the process's denormal handling.
A machine that cannot build them gets the torch reference, with one warning.
"""

from __future__ import annotations

import functools
import logging
import os

log = logging.getLogger("inflight")

HERE = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(HERE)
BUILD_DIR = os.path.join(REPO_ROOT, ".build", "cpu_kernels")
SOURCES = [os.path.join(HERE, "cpu", name) for name in ("bindings.cpp", "paged_attention.cpp", "layer_ops.cpp", "activation.cpp", "gemm.cpp")]
FLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-funsafe-math-optimizations", "-ffinite-math-only"]


@functools.cache
def load():
    """The compiled module, or None where it cannot be built (see the warning)."""
    try:
        import ninja  # the pip package: its binary need not be on PATH (Triton's stub has no venv PATH)
        from torch.utils.cpp_extension import load as load_extension

        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
        os.makedirs(BUILD_DIR, exist_ok=True)
        return load_extension(name="inflight_cpu_kernels", sources=SOURCES, extra_cflags=FLAGS, extra_ldflags=["-fopenmp"],
                              build_directory=BUILD_DIR, verbose=False)
    except Exception as exc:  # noqa: BLE001 - no compiler, no headers: serve with the reference instead
        log.warning("C++ CPU kernels unavailable (%s); using the torch reference", exc)
        return None


def build() -> None:
    """`make setup`'s step: build now; the module's file is make's stamp (touched when current)."""
    logging.basicConfig(format="%(levelname)s %(message)s")
    module = load()
    if module is not None:
        os.utime(module.__file__)
