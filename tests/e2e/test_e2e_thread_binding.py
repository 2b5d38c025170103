"""omp_threads_bind through tritonserver: the stub's engine thread and its OpenMP worker run
one per CPU listed, every other thread of the stub stays off the engine thread's CPU, and
greedy text is still transformers' (the policy's unit tests: tests/unit/test_thread_binding.py)."""

from __future__ import annotations

import os
import re

import pytest
import transformers

from tests.checkpoints import hf_greedy

PROMPT = "The capital of France is"
MAX_TOKENS = 12


def descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parent = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(parent, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def stub_thread_cpus(server_pid: int) -> dict[int, set[int]]:
    stubs = []
    for pid in descendants(server_pid):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"triton_python_backend_stub" in f.read():
                    stubs.append(pid)
        except OSError:
            continue
    assert len(stubs) == 1, f"expected one stub process under tritonserver, found {stubs}"
    return {int(tid): os.sched_getaffinity(int(tid)) for tid in os.listdir(f"/proc/{stubs[0]}/task")}


@pytest.mark.e2e
def test_the_stub_pins_its_openmp_team_and_keeps_its_other_threads_off_the_engine_cpu(tritonserver, tiny_checkpoint):
    import tritonclient.grpc as grpcclient

    from client.triton import make_inputs, stream_generate, text_of

    allowed = sorted(os.sched_getaffinity(0))
    assert len(allowed) >= 2, "this test needs a machine of at least 2 CPUs (CI has 2)"
    cpus = [allowed[1], allowed[0]]  # an order of our own, not the kernel's
    parameters = {"model_path": tiny_checkpoint, "max_num_seqs": "4", "kv_cache_memory_mb": "64", "max_model_len": "256",
                  "omp_threads_bind": f"{cpus[0]},{cpus[1]}"}
    with tritonserver({"llm": parameters}, env={"OMP_NUM_THREADS": "2"}) as server:
        found = re.search(r"OpenMP threads \[(\d+), (\d+)\] on CPUs \[(\d+), (\d+)\]", server.log())
        assert found, server.log_tail()
        team, team_cpus = [int(found[1]), int(found[2])], [int(found[3]), int(found[4])]
        assert team_cpus == cpus
        threads = stub_thread_cpus(server.proc.pid)
        assert [threads[tid] for tid in team] == [{cpus[0]}, {cpus[1]}], threads
        others = {tid: mask for tid, mask in threads.items() if tid not in team}
        assert others and all(cpus[0] not in mask for mask in others.values()), others

        client = grpcclient.InferenceServerClient(server.grpc_url)
        try:
            sampling = {"temperature": 0, "max_tokens": MAX_TOKENS, "ignore_eos": True}
            responses = list(stream_generate(client, "llm", make_inputs(PROMPT, sampling), timeout_s=120))
        finally:
            client.close()
    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_checkpoint)
    expected = hf_greedy(tiny_checkpoint, [tokenizer.encode(PROMPT)], MAX_TOKENS)[0]
    assert "".join(text_of(r) for r in responses) == tokenizer.decode(expected)
