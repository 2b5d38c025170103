"""The AMX tiles are the default bf16 GEMM path wherever the build has them: `cpu_ext.isa()`
picks them, `INFLIGHT_CPU_ISA` still caps them, a kernel that refuses the process the tiles
(arch_prctl ARCH_REQ_XCOMP_PERM) gets the best vector path with one warning, every bf16 GEMM
of the model (projections, LoRA, the output head, tied or not) is packed for them, and the
engine stays batch invariant on them.

Each check runs in a process of its own (`isa()` is decided once a process) on the build in
which the tiles are a software model (INFLIGHT_CPU_AMX_EMULATE=1, kernels/cpu/amx.h), so
it runs on any CPU; on an AMX Xeon tests/kernels/test_linear.py runs the same paths on the
hardware."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from backend.paths import REPO_ROOT
from kernels import cpu_ext
from kernels.cpu_ext import Isa

WARNING = "refused this process the AMX tiles"


def _tile_model_env(**extra: str) -> dict[str, str]:
    env = {**os.environ, "INFLIGHT_CPU_AMX_EMULATE": "1", **extra}
    if "INFLIGHT_CPU_ISA" not in extra:
        env.pop("INFLIGHT_CPU_ISA", None)
    return env


def _python(script: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    run = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True,
                         timeout=1800, env=env, cwd=REPO_ROOT)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    return run


def _machine_vector_isa() -> Isa:
    """The best path without tiles of this machine's own build (what the tile model's build
    has beside its tiles)."""
    module = cpu_ext.load()
    assert module is not None, "kernels/cpu_ext.py could not build the C++ kernels (see its warning)"
    return Isa(module.gemm_vector_isa())


def _isa_names(env: dict[str, str], before: str = "") -> tuple[list[str], str]:
    run = _python(f"""
        import logging
        logging.basicConfig(format="%(levelname)s %(message)s")
        from kernels import cpu_ext
        {before}
        print(cpu_ext.built_isa().name, cpu_ext.isa().name, cpu_ext.vector_isa().name)
    """, env)
    return run.stdout.split(), run.stderr


def test_the_default_is_the_tiles_where_the_build_has_them():
    names, stderr = _isa_names(_tile_model_env())
    assert names == ["AMX", "AMX", min(_machine_vector_isa(), Isa.AVX512_BF16).name]
    assert WARNING not in stderr


@pytest.mark.parametrize("cap", ["amx", "avx512_bf16", "avx2", "none"])
def test_inflight_cpu_isa_still_caps_the_tiles(cap):
    names, _ = _isa_names(_tile_model_env(INFLIGHT_CPU_ISA=cap))
    want = Isa.AMX if cap == "amx" else min(Isa[cap.upper()], _machine_vector_isa())
    assert names[1] == want.name


def test_a_refused_permission_falls_back_to_the_vector_path_with_one_warning():
    vector = _machine_vector_isa()
    run = _python("""
        import logging
        import torch
        logging.basicConfig(format="%(levelname)s %(message)s")
        import kernels
        from kernels import cpu_ext
        cpu_ext.amx_permission = lambda: False  # a kernel that says no to ARCH_REQ_XCOMP_PERM
        print(cpu_ext.isa().name, cpu_ext.isa().name, cpu_ext.vector_isa().name)
        packed = kernels.pack_linear_weight(torch.randn(64, 96).bfloat16())
        print(packed.isa.name)
    """, _tile_model_env())
    first, packed = run.stdout.splitlines()
    assert first.split() == [vector.name] * 3
    # A bf16 weight goes to the bf16 vector path, or its float32 upcast on a CPU without one.
    assert packed == (vector if vector >= Isa.AVX512_BF16 else min(vector, Isa.AVX512)).name
    assert run.stderr.count(WARNING) == 1, run.stderr
    assert "ARCH_REQ_XCOMP_PERM" in run.stderr and vector.name.lower() in run.stderr


def test_every_bf16_gemm_of_the_model_is_packed_for_the_tiles(tmp_path):
    """Projections, LoRA's matmuls and the output head, tied (llama) and not (mistral), in the
    engine as it loads, and the engine then serves greedy tokens on the tile path."""
    run = _python(f"""
        from backend.config import EngineConfig
        from backend.engine import LLMEngine
        from backend.models.llama import Linear
        from backend.request import SamplingParams
        from tests.checkpoints import make_random_adapter, make_tiny_checkpoint

        for family in ("llama", "mistral"):
            base = make_tiny_checkpoint("{tmp_path}/" + family, family=family)
            adapter = make_random_adapter("{tmp_path}/" + family + "-adapter", base, rank=8, seed=1)
            engine = LLMEngine(EngineConfig(model_path=base, dtype="bfloat16", device="cpu", num_kv_blocks=64,
                                            lora_modules={{"a": adapter}}, max_lora_rank=8))
            model = engine.model
            packed = {{}}
            for name, module in model.named_modules():
                if isinstance(module, Linear):
                    packed[name] = module.packed
                    if module.lora is not None:
                        for i, (a, bs) in enumerate(module.lora.packed):
                            packed[f"{{name}}.lora_a[{{i}}]"] = a
                            packed.update({{f"{{name}}.lora_b[{{i}}][{{s}}]": b for s, b in enumerate(bs)}})
            if model.lm_head is None:
                packed["tied_lm_head"] = model.tied_lm_head_packed
            assert ("lm_head" in packed) == (family == "mistral"), sorted(packed)
            assert any(".lora_a[" in name for name in packed) and any(".lora_b[" in name for name in packed)
            wrong = {{name: p if p is None else (p.kind, p.isa.name) for name, p in packed.items()
                     if p is None or (p.kind, p.isa.name, p.upcast) != ("panels", "AMX", False)}}
            assert not wrong, wrong
            assert model.cpu_layers is not None  # each layer one C++ call, on the tiles
            engine.add_request("r", [5, 6, 7, 8, 9], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
            engine.add_request("s", [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True,
                                                              lora_name="a"))
            done = {{}}
            while engine.has_unfinished():
                for out in engine.step():
                    assert out.error is None, out.error
                    done.setdefault(out.request_id, []).extend(out.token_ids_delta)
            assert sorted(len(t) for t in done.values()) == [4, 4], done
            print(family, len(packed), "packed for AMX")
    """, _tile_model_env())
    assert "llama" in run.stdout and "mistral" in run.stdout


@pytest.mark.timeout(1800)  # the tile model is scalar code: minutes on a small CPU
def test_the_engine_stays_batch_invariant_on_the_tiles():
    """tests/engine/test_batch_invariance.py's hand-picked bfloat16 schedules (preemption by
    recompute and swap, a prefix-cache hit, one thread or two) and the LoRA kernel's check, on
    the tiles. (Its random schedules and long chunks take too long on the scalar model; on an
    AMX Xeon the whole file runs on the hardware.)"""
    summary = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs",
         "tests/engine/test_batch_invariance.py", "tests/kernels/test_lora.py::test_lora_delta_cpu_packed_is_batch_invariant",
         "-k", "bfloat16 and (preemption or prefix_cache or thread_count or lora)"],
        capture_output=True, text=True, timeout=3600, env=_tile_model_env(), cwd=REPO_ROOT)
    assert summary.returncode == 0, summary.stdout[-4000:] + summary.stderr[-2000:]
    last = summary.stdout.strip().splitlines()[-1]
    assert "passed" in last and "failed" not in last and "skipped" not in last, last
