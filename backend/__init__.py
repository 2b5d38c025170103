"""inflight: the engine (scheduler, KV-cache manager, model runner) and its Triton backend."""

import os
import sys

# libgomp, the thread pool of torch, MKL and oneDNN on CPU, lets an idle worker spin for
# only ~0.1 ms (GOMP_SPINCOUNT 300k) before it sleeps in the kernel. A decode step is
# hundreds of parallel ops with tens of microseconds of Python between them, so workers
# kept falling asleep and had to be woken for the next op: on this project's 2-core VM,
# decode steps took 49-87 ms at the median instead of 48-60, with single steps of 1.5 s.
# 10M spins keep them awake through a step and let them sleep a few ms after the engine
# goes idle (vLLM's CPU backend gets the same from Intel OpenMP's 200 ms block time).
# libgomp reads the variable once, when torch first loads it: hence here, before any
# module of the engine imports torch. A value set by the user is kept.
if "torch" not in sys.modules:
    os.environ.setdefault("GOMP_SPINCOUNT", "10000000")
