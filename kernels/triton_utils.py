"""Launch helpers shared by the Triton kernels.

`launch(kernel, grid, *args, **kwargs)` runs the compiled kernel when the first tensor
argument lives on a GPU, and Triton's interpreter (what `TRITON_INTERPRET=1` selects) when
it lives on the CPU. The interpreter runs the kernel body program by program on numpy
arrays, which is how the `*_triton` functions are tested on a machine without a GPU.

`triton.jit` picks "interpreted" or "compiled" once, when a function is decorated, and
that includes triton.language's own jit helpers (`tl.max`, `tl.sum`, `tl.cdiv`, ...),
decorated when triton is imported. Setting `TRITON_INTERPRET=1` before triton is
imported makes everything interpreted; when it is not (say another test module imported
the engine first), a CPU launch wraps the kernel in the interpreter itself and, for the
duration of that launch only, swaps triton.language's jit helpers for interpreted ones.
CUDA launches never take that path.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import types

import torch
import triton
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction

_interpreted: dict[int, InterpretedFunction] = {}
_swap_lock = threading.Lock()


def _as_interpreted(fn) -> InterpretedFunction:
    if isinstance(fn, InterpretedFunction):
        return fn
    raw = getattr(fn, "fn", fn)
    wrapped = _interpreted.get(id(raw))
    if wrapped is None:
        wrapped = _interpreted[id(raw)] = InterpretedFunction(raw)
    return wrapped


@contextlib.contextmanager
def _interpreted_language():
    """Temporarily replace the compiled jit helpers of triton.language by interpreted ones."""
    # Modules that triton imports lazily while launching (the specialisation code pulls in
    # gluon, which checks the helpers' types) must be imported before the swap.
    triton.runtime.jit.mangle_type(1)
    with _swap_lock:
        saved = []
        modules = [m for name, m in list(sys.modules.items())
                   if name.startswith("triton.language") and isinstance(m, types.ModuleType)]
        for module in modules:
            for name, obj in list(vars(module).items()):
                if isinstance(obj, JITFunction):
                    saved.append((module, name, obj))
                    setattr(module, name, _as_interpreted(obj))
        try:
            yield
        finally:
            for module, name, obj in saved:
                setattr(module, name, obj)


def launch(kernel, grid, *args, **kwargs) -> None:
    """`kernel[grid](*args, **kwargs)`, interpreted when the tensors are on the CPU."""
    device = next(a.device for a in args if isinstance(a, torch.Tensor))
    interpreted = isinstance(kernel, InterpretedFunction)   # TRITON_INTERPRET=1 at import
    if device.type != "cpu" and not interpreted:
        # FMA contraction on, explicitly (Triton 3.9 warns when left to its default).
        kwargs.setdefault("enable_fp_fusion", True)
        kernel[grid](*args, **kwargs)
        return
    # Compile-only options mean nothing to the interpreter.
    for option in ("num_warps", "num_stages", "num_ctas", "maxnreg", "enable_fp_fusion"):
        kwargs.pop(option, None)
    if interpreted:
        kernel[grid](*args, **kwargs)
        return
    with _interpreted_language():
        _as_interpreted(kernel)[grid](*args, **kwargs)


def next_power_of_2(n: int) -> int:
    return triton.next_power_of_2(int(n))


def dot_precision(element_size: int) -> str:
    """`tl.dot`'s input precision for operands of `element_size` bytes: IEEE for float32, so a
    float32 model's kernels round as its cuBLAS GEMMs do; TF32 otherwise (16-bit operands
    ignore it, and a 16-bit model's float32 intermediates keep more bits than its output)."""
    return "ieee" if element_size == 4 else "tf32"
