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

`isa()` is the instruction set the kernels run with, decided once per process: the best the
build has (so the machine's own), capped by `INFLIGHT_CPU_ISA` (`avx2`, `avx512`,
`avx512_bf16`, `amx` or `none`), e.g. to run the AVX2 paths on an AVX-512 machine. On a Xeon
with AMX that is the AMX tiles for every bf16 GEMM (the panel GEMM: projections, LoRA, the
output head). Linux lends a process the tiles only when it asks (arch_prctl
ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA, `amx_permission()`); where the kernel refuses
(an old kernel, a sandbox that filters the call), `isa()` takes the best vector path instead,
AVX512_BF16, with one warning. `vector_isa()` is the best path without tiles: what the
attention, the sampler and the float32 GEMM run with.

`INFLIGHT_CPU_MARCH` compiles them for another machine than this one (g++'s `-march`, e.g.
`x86-64-v3`: any CPU with AVX2 and FMA), into a build of its own: how the tests compile and run
an AVX2-only machine's kernels on an AVX-512 one, and a build for a fleet of mixed CPUs.

`INFLIGHT_CPU_AMX_EMULATE=1` runs the AMX paths on a software model of the tile instructions
(kernels/cpu/amx.h), on any CPU, in the same build (`use_tile_model`): how the tests check the
tile kernels' logic where no AMX is at hand. Never for serving: it is scalar code.
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
SOURCES = [os.path.join(HERE, "cpu", name) for name in ("bindings.cpp", "paged_attention.cpp", "layer_ops.cpp", "activation.cpp", "gemm.cpp", "gemm_quant.cpp", "gemm_int8_dots.cpp", "decoder_layer.cpp", "threads.cpp", "sampling.cpp", "huge_pages.cpp")]
FLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-funsafe-math-optimizations", "-ffinite-math-only"]


class Isa(enum.IntEnum):
    """The C++ kernels' code paths by instruction set (gemm.cpp numbers them the same way)."""

    NONE = 0
    AVX2 = 1  # float32 GEMM, 8-lane attention
    AVX512 = 2  # float32 GEMM, 16-lane attention
    AVX512_BF16 = 3  # bfloat16 GEMM with vdpbf16ps
    AMX = 4  # bfloat16 GEMM on AMX tiles


# quant_panel_gemm's path of int8 activations (kernels/cpu/gemm_int8_dots.cpp), in the place of an
# instruction set: it runs on the best one the build has (the module's int8_dots_path()).
QUANT_INT8_DOTS = 5
# quant_panel_gemm's path on bf16 dot products (vdpbf16ps on the exact int8/int4 integers, each
# group's scale and min applied to its sums): a bf16 model's every call where there are no tiles in the
# batch-invariant mode, and its decode of a few rows outside it.
QUANT_BF16_DOTS = 6


def built_isa() -> Isa:
    """The best path the build has, whatever `INFLIGHT_CPU_ISA` or the kernel's permission
    for the AMX tiles lets the engine use; NONE without the build."""
    module = load()
    return Isa(module.gemm_isa()) if module is not None else Isa.NONE


def amx_permission() -> bool:
    """Whether Linux lends this process the AMX tiles (asked once; the answer holds for the
    process's life). The tests replace it to play a kernel that refuses."""
    return bool(load().request_amx_permission())


@functools.cache
def isa() -> Isa:
    """The best path of this machine's build, capped by `INFLIGHT_CPU_ISA`; without the
    kernel's permission for the AMX tiles the best vector path, with one warning; NONE
    without the build."""
    best = built_isa()
    cap = os.environ.get("INFLIGHT_CPU_ISA", "").strip().upper()
    if cap and cap not in Isa.__members__:
        raise ValueError(f"INFLIGHT_CPU_ISA={cap.lower()!r}: expected one of {', '.join(i.name.lower() for i in Isa)}")
    chosen = min(best, Isa[cap]) if cap else best
    if Isa.NONE < chosen < Isa.AMX:  # a build whose tiles are a software model may lack the paths between
        chosen = min(chosen, Isa(load().gemm_vector_isa()))
    elif chosen == Isa.AMX and not amx_permission():
        chosen = Isa(load().gemm_vector_isa())
        log.warning("the kernel refused this process the AMX tiles (arch_prctl ARCH_REQ_XCOMP_PERM for "
                    "XFEATURE_XTILEDATA); the bf16 GEMMs run on %s instead", chosen.name.lower())
    return chosen


def vector_isa() -> Isa:
    """`isa()` without the AMX tiles: the vector path the attention, the sampler and the
    float32 GEMM run with (on an AMX Xeon, AVX512_BF16)."""
    module = load()
    return min(isa(), Isa(module.gemm_vector_isa())) if module is not None else Isa.NONE


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
        os.makedirs(build_dir, exist_ok=True)
        module = load_extension(name=name, sources=SOURCES, extra_cflags=flags, extra_ldflags=["-fopenmp"],
                                build_directory=build_dir, verbose=False)
        if os.environ.get("INFLIGHT_CPU_AMX_EMULATE") == "1":
            module.use_tile_model()
        return module
    except Exception as exc:  # no compiler, no headers: serve with the reference instead
        log.warning("C++ CPU kernels unavailable (%s); using the torch reference", exc)
        return None


def build() -> None:
    """`make setup`'s step: build now; the module's file is make's stamp (touched when current)."""
    logging.basicConfig(format="%(levelname)s %(message)s")
    module = load()
    if module is not None:
        os.utime(module.__file__)
