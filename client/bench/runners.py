"""The systems that run in this process: the engine (any policy or setting) and Hugging
Face `generate()` in static padded batches. Each returns a `SystemRun` with one
`RequestRecord` per workload request, in workload order."""

from __future__ import annotations

import collections
import time

import torch
from tqdm import tqdm
from transformers import AutoModelForCausalLM

from backend.config import EngineConfig
from backend.engine import LLMEngine
from backend.request import SamplingParams
from client.bench.records import RequestRecord, SystemRun
from client.bench.stats import safe_ratio
from client.bench.workloads import Workload


def run_engine(workload: Workload, model_path: str, overrides: dict, system: str, progress: bool = True,
               concurrency: int | None = None, structured_outputs: dict | None = None,
               separate_sequences: bool = False) -> SystemRun:
    """The workload through this engine in-process, open loop, or closed loop with `concurrency`
    (or per tenant, `workload.tenant_concurrency`). Records each tenant's cumulative service
    over time (`service_timeline`). With `structured_outputs`, every other request (even
    indices) carries that constraint.

    A request with n > 1 sequences is one request with `n` (its sequences seeded s, s+1, ...),
    or with `separate_sequences` n requests of one sequence each, seeded the same (W7's peer).
    Either way its record counts all its sequences' tokens, and it ends when the last does."""
    config = EngineConfig(model_path=model_path, **{**workload.engine_overrides, **overrides})
    engine = LLMEngine(config)
    _warm_up(engine)
    pending = sorted(range(len(workload.requests)), key=lambda i: workload.requests[i].arrival_s)
    records = [RequestRecord(arrival=0.0, expected_output_tokens=r.max_tokens * r.n, label=r.label)
               for r in workload.requests]
    # Engine requests still running, per workload request.
    live: dict[int, int] = {}
    totals_before = engine.stats.totals
    start = time.perf_counter()
    bar = tqdm(total=len(pending), desc=f"{workload.name} {system}", unit="req", disable=not progress, leave=False)
    seeded = 0
    in_flight = 0
    in_flight_by_tenant: collections.Counter[str] = collections.Counter()
    service: dict[str, float] = {}
    timeline: dict[str, list[float]] = {"t_s": []}
    last_sample = -1.0

    def due(index: int, now: float) -> bool:
        spec = workload.requests[index]
        if concurrency:
            return in_flight < concurrency
        limit = workload.tenant_concurrency.get(spec.tenant)
        return spec.arrival_s <= now and (limit is None or in_flight_by_tenant[spec.tenant] < limit)

    while pending or engine.has_unfinished():
        now = time.perf_counter() - start
        sent = []
        for index in pending:
            if not concurrency and workload.requests[index].arrival_s > now:
                break  # in arrival order: the rest are later still
            if not due(index, now):
                continue
            spec = workload.requests[index]
            seeded += 1
            seed = seeded if spec.temperature > 0 else None
            params = SamplingParams(
                temperature=spec.temperature, max_tokens=spec.max_tokens, ignore_eos=True,
                priority=spec.priority, seed=seed, tenant=spec.tenant, n=spec.n,
                lora_name=spec.lora_name, structured_outputs=structured_outputs if index % 2 == 0 else None,
            )
            if separate_sequences and spec.n > 1:
                for i in range(spec.n):
                    one = params.model_copy(update={"n": 1, "seed": None if seed is None else seed + i})
                    engine.add_request(f"{index}.{i}", spec.prompt_token_ids, one)
                live[index] = spec.n
            else:
                engine.add_request(str(index), spec.prompt_token_ids, params)
                live[index] = 1
            seeded += spec.n - 1
            records[index].arrival = time.perf_counter()
            sent.append(index)
            in_flight += 1
            in_flight_by_tenant[spec.tenant] += 1
        if sent:
            sent_set = set(sent)
            pending = [i for i in pending if i not in sent_set]
        if not engine.has_unfinished():
            time.sleep(max(0.0, min(0.01, workload.requests[pending[0]].arrival_s - now)))
            continue
        outputs = engine.step()
        now_abs = time.perf_counter()
        for tenant, value in engine.stats.step.service_by_tenant:
            service[tenant] = service.get(tenant, 0.0) + value
        if now_abs - start - last_sample >= 0.25 or not (pending or engine.has_unfinished()):
            last_sample = now_abs - start
            _sample(timeline, last_sample, service)
        for out in outputs:
            index = int(out.request_id.split(".")[0])
            record = records[index]
            new_tokens = (sum(len(s.token_ids_delta) for s in out.sequences if s) if out.sequences
                          else len(out.token_ids_delta))
            if new_tokens:
                record.token_times.extend([now_abs] * new_tokens)
            record.num_output_tokens += new_tokens
            if out.finished:
                live[index] -= 1
            if out.finished and not live[index]:
                in_flight -= 1
                in_flight_by_tenant[workload.requests[index].tenant] -= 1
                record.finish_reason = out.finish_reason
                if out.error is not None:
                    record.error = str(out.error)
                    record.finish_reason = None
                if out.first_scheduled_time is not None:
                    record.queue_time = out.first_scheduled_time - out.arrival_time
                bar.update(1)
    duration = time.perf_counter() - start
    bar.close()
    totals = engine.stats.totals.since(totals_before)
    steps = totals.steps
    kpis = {
        "iterations": steps,
        "slot_occupancy": totals.sum_running / max(1, steps) / config.max_num_seqs,
        "tokens_per_iteration": totals.sum_scheduled_tokens / max(1, steps),
        **{f"{name}_ms_per_iteration": 1e3 * getattr(totals, f"sum_{phase}_time_s") / max(1, steps)
           for name, phase in (("scheduler", "schedule"), ("prepare", "prepare"), ("forward", "forward"),
                               ("update", "update"))},
        "preemptions": totals.preemptions,
        "prefix_hit_rate": safe_ratio(totals.prefix_hit_tokens, totals.prefix_query_tokens),
        "num_kv_blocks": engine.num_kv_blocks,
        "max_num_seqs": config.max_num_seqs,
        "dtype": str(engine.dtype).replace("torch.", ""),
        "torch_threads": torch.get_num_threads(),
        **({"spec_drafts": totals.spec_drafts, "spec_draft_tokens": totals.spec_draft_tokens,
            "spec_accepted_tokens": totals.spec_accepted_tokens,
            "spec_acceptance_rate": safe_ratio(totals.spec_accepted_tokens, totals.spec_draft_tokens),
            "spec_accepted_per_position": list(totals.spec_accepted_per_position),
            "spec_trimmed_draft_tokens": totals.spec_trimmed_draft_tokens}
           if engine.speculative is not None else {}),
        "service_by_tenant": service,
        "service_timeline": timeline,
    }
    del engine
    return SystemRun(system, records, duration, kpis, concurrency=concurrency)


def _sample(timeline: dict[str, list[float]], t: float, service: dict[str, float]) -> None:
    """One point of each tenant's cumulative service; a tenant first seen now starts at 0 before."""
    for tenant in service:
        timeline.setdefault(tenant, [0.0] * len(timeline["t_s"]))
    timeline["t_s"].append(round(t, 3))
    for tenant, values in timeline.items():
        if tenant != "t_s":
            values.append(service.get(tenant, 0.0))


def _warm_up(engine) -> None:
    """One short request first: the first forward pass pays for allocator and kernel setup."""
    engine.add_request("warmup", list(range(1000, 1040)), SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    engine.reset_prefix_cache()


def run_hf_static(workload: Workload, model_path: str, batch_size: int, dtype: str = "float32",
                  progress: bool = True, device: torch.device | str = "cpu") -> SystemRun:
    """Hugging Face `generate()` in static padded batches of `batch_size`, arrival order, in
    `dtype` on `device` (the engine's).

    A batch runs until its longest member is done; shorter members' extra tokens are
    waste and are not counted. All of a batch's tokens arrive when the batch ends, so
    TTFT is the batch's end (generate() streams nothing).
    """
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype)).to(device).eval()
    records = [RequestRecord(arrival=0.0, expected_output_tokens=r.max_tokens, label=r.label) for r in workload.requests]
    order = sorted(range(len(workload.requests)), key=lambda i: workload.requests[i].arrival_s)
    start = time.perf_counter()
    for i in order:
        records[i].arrival = start + workload.requests[i].arrival_s
    bar = tqdm(total=len(order), desc=f"{workload.name} hf-static", unit="req", disable=not progress, leave=False)
    with torch.inference_mode():
        for b in range(0, len(order), batch_size):
            batch = order[b : b + batch_size]
            specs = [workload.requests[i] for i in batch]
            wait = max(s.arrival_s for s in specs) - (time.perf_counter() - start)
            if wait > 0:
                time.sleep(wait)
            longest = max(len(s.prompt_token_ids) for s in specs)
            ids = torch.zeros((len(specs), longest), dtype=torch.long)
            mask = torch.zeros_like(ids)
            for row, s in enumerate(specs):  # left padding, as generate() expects
                ids[row, longest - len(s.prompt_token_ids):] = torch.tensor(s.prompt_token_ids)
                mask[row, longest - len(s.prompt_token_ids):] = 1
            model.generate(ids.to(device), attention_mask=mask.to(device), max_new_tokens=max(s.max_tokens for s in specs),
                           min_new_tokens=max(s.max_tokens for s in specs), do_sample=False,
                           eos_token_id=None, pad_token_id=0)
            if torch.device(device).type == "cuda":
                torch.cuda.synchronize(device)
            done = time.perf_counter()
            for i, s in zip(batch, specs):
                records[i].token_times = [done] * s.max_tokens
                records[i].num_output_tokens = s.max_tokens
                records[i].finish_reason = "length"
                records[i].queue_time = 0.0
            bar.update(len(batch))
    bar.close()
    return SystemRun("hf-static", records, time.perf_counter() - start,
                     {"batch_size": batch_size, "dtype": dtype, "device": str(device)})
