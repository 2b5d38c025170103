"""The C++ CPU kernels (kernels/cpu/*.cpp), compiled once per machine and loaded.

torch's extension builder compiles them with g++ and ninja into `.build/cpu_kernels/`
(git-ignored) on first use; `make setup` does it ahead of time (`build()`), so neither a test nor the
Triton backend's first request waits for the compiler. `-march=native`: the build runs on
the machine that serves, and the kernels' inner loops are what the vector units are for;
no errno, reassociation and finite math let g++ vectorise expf (glibc's libmvec) and the
reductions: with a scalar expf, softmax is decode attention's largest cost (layer_ops.cpp opts
out: it matches the torch references' roundings). Compile flags only:
linked without -ffast-math, the module never changes the process's denormal handling.
A machine that cannot build them gets the torch reference, with one warning.

`isa()` is the instruction set the kernels run with: the best the build has (so the
machine's own), capped by `INFLIGHT_CPU_ISA` (`avx2`, `avx512`, `avx512_bf16`, `amx` or
`none`), e.g. to run the AVX2 paths on an AVX-512 machine. AMX tiles are built where the CPU
has them but run only with `INFLIGHT_CPU_ISA=amx` until they are measured on an AMX machine;
by default an AMX Xeon runs the AVX512-BF16 path.

`INFLIGHT_CPU_MARCH` compiles them for another machine than this one (g++'s `-march`, e.g.
`x86-64-v3`: any CPU with AVX2 and FMA), into a build of its own: how the tests compile and run
an AVX2-only machine's kernels on an AVX-512 one, and a build for a fleet of mixed CPUs.

`INFLIGHT_CPU_AMX_EMULATE=1` builds a second module in which the AMX path runs on a software
model of the tile instructions (kernels/cpu/gemm.cpp), on any CPU: how the tests check the
tile kernel's logic where no AMX is at hand. Never for serving: it is scalar code.
"""

from __future__ import annotations

import enum
import functools
import logging
import os
import re

log = logging.getLogger("inflight")

HERE = os.path.dirname(os.path.abspath(__file__))
# .build/ at the repository root (git-ignored). kernels/ imports nothing of the project, so
# it finds the root from its own place rather than from backend.paths.
BUILD_DIR = os.path.join(os.path.dirname(HERE), ".build", "cpu_kernels")
SOURCES = [os.path.join(HERE, "cpu", name) for name in ("bindings.cpp", "paged_attention.cpp", "layer_ops.cpp", "activation.cpp", "gemm.cpp", "decoder_layer.cpp", "threads.cpp", "sampling.cpp")]
FLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-funsafe-math-optimizations", "-ffinite-math-only"]


class Isa(enum.IntEnum):
    """The C++ kernels' code paths by instruction set (gemm.cpp numbers them the same way)."""

    NONE = 0
    AVX2 = 1  # float32 GEMM, 8-lane attention
    AVX512 = 2  # float32 GEMM, 16-lane attention
    AVX512_BF16 = 3  # bfloat16 GEMM with vdpbf16ps
    AMX = 4  # bfloat16 GEMM on AMX tiles (opt-in: INFLIGHT_CPU_ISA=amx)


def built_isa() -> Isa:
    """The best path the build has, whatever `INFLIGHT_CPU_ISA` lets the engine use; NONE
    without the build."""
    module = load()
    return Isa(module.gemm_isa()) if module is not None else Isa.NONE


@functools.cache
def isa() -> Isa:
    """The best path of this machine's build, capped by `INFLIGHT_CPU_ISA` (by default at
    AVX512_BF16: AMX is opt-in); NONE without the build."""
    best = built_isa()
    cap = os.environ.get("INFLIGHT_CPU_ISA", "").strip().upper()
    if not cap:
        return min(best, Isa.AVX512_BF16)
    if cap not in Isa.__members__:
        raise ValueError(f"INFLIGHT_CPU_ISA={cap.lower()!r}: expected one of {', '.join(i.name.lower() for i in Isa)}")
    return min(best, Isa[cap])


@functools.cache
def load():
    """The compiled module, or None where it cannot be built (see the warning)."""
    try:
        import ninja  # the pip package: its binary need not be on PATH (Triton's stub has no venv PATH)
        from torch.utils.cpp_extension import load as load_extension

        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
        name, build_dir, flags = "inflight_cpu_kernels", BUILD_DIR, FLAGS
        march = os.environ.get("INFLIGHT_CPU_MARCH", "").strip()
        if march and march != "native":
            suffix = "_" + re.sub(r"\W", "_", march)
            name, build_dir = name + suffix, build_dir + suffix
            flags = [f"-march={march}" if flag == "-march=native" else flag for flag in flags]
        if os.environ.get("INFLIGHT_CPU_AMX_EMULATE") == "1":
            name, build_dir, flags = name + "_amx_model", build_dir + "_amx_model", flags + ["-DINFLIGHT_AMX_EMULATE"]
        os.makedirs(build_dir, exist_ok=True)
        return load_extension(name=name, sources=SOURCES, extra_cflags=flags, extra_ldflags=["-fopenmp"],
                              build_directory=build_dir, verbose=False)
    except Exception as exc:  # no compiler, no headers: serve with the reference instead
        log.warning("C++ CPU kernels unavailable (%s); using the torch reference", exc)
        return None


def build() -> None:
    """`make setup`'s step: build now; the module's file is make's stamp (touched when current)."""
    logging.basicConfig(format="%(levelname)s %(message)s")
    module = load()
    if module is not None:
        os.utime(module.__file__)
