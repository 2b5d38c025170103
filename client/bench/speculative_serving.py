"""W9 against llama.cpp's llama-server (docs/benchmarks.md, issue 48): speculative decoding as a
user meets it, through each system's server, on the same model and the same requests.

    python -m client.bench.speculative_serving --concurrency 1,4 --requests 8 --chat-requests 4

(the defaults: an estimated 8 to 10 minutes on a quiet 2-core AVX2 machine, from the engine's
W9 rates there and each server's start).

The requests are W9's (client/bench/speculative.py): W9a, passages of the project's fixed text
inside a copy-edit instruction, at each `--concurrency` (each concurrency with passages of its
own, seed + its index, so no server meets a prompt it has cached); W9b, the built-in chat
prompts at concurrency 1 (`--chat-requests 0` skips it). Greedy, `--max-tokens` out, EOS
ignored. Each system starts fresh for each of its speculation settings, runs every workload
through its OpenAI endpoint (client.bench.targets) and stops:

- `tritonserver`: model_repository/llm's config on the float checkpoint in float32 (the KV
  cache too) behind the OpenAI frontend, with `speculative_config` each of ENGINE_METHODS
  (speculative.METHODS' settings; `off`: none);
- `llama-server`: the checkpoint converted to an f32 GGUF by llama.cpp's converter, KV in
  f32 (client/bench/llama_cpp.py's settings), with each of LLAMA_METHODS: its n-gram
  speculation and its draft model speculation with the Q8_0 GGUF of the same checkpoint as
  the draft (`off`: none).

Both run on the first `--cores` CPUs of this process with `--slots` sequences at once (the
engine's max_num_seqs, llama-server's --parallel; default the highest concurrency).

`--rounds N` runs the whole comparison N times, every server fresh each time and the settings
in reverse order every other round, so that both systems meet the same minutes of a VM whose
memory bandwidth drifts by a third from one minute to the next; each ratio is then the median
of the rounds' ratios (`ratios`; each round's own in `ratios_by_round`), a round's ratio over
llama-server's fastest speculation in that round. The
report (bench/results/<cpu kind>/w9_vs_llama_server.json by default) holds every run, the
versions of both servers, and per workload and concurrency: each of the engine's methods over
llama-server's fastest speculation (issue 48's target: 1.3x output tokens/s at concurrency 1
and 4), each system's speculation over its own speculation off (output tokens/s and TPOT p50),
and whether the greedy texts agree: the engine's methods must give its `off` text (the run
fails otherwise); llama-server's speculative text against its own `off` is recorded, as is
llama-server's `off` against the engine's.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from collections import Counter
from functools import partial

import numpy as np
from transformers import AutoTokenizer

from backend.paths import DEFAULT_CHECKPOINT, REPO_ROOT
from client.bench import llama_cpp, servers
from client.bench.records import machine, write_report
from client.bench.servers import first_cpus, llama_server, parse_concurrencies, tritonserver
from client.bench.speculative import METHODS, w9a_grounded, w9b_chat
from client.bench.stats import safe_ratio, summarize
from client.bench.targets import parse_target, run_target

SYSTEMS = ("tritonserver", "llama-server")
BASE_MODEL = REPO_ROOT / "model_repository" / "llm"
# The engine's methods that need no draft checkpoint (its best at low load, issue 48), and `off`.
ENGINE_METHODS = ("off", "ngram", "suffix")
# llama-server's speculation (`--spec-type`, llama.cpp's docs/speculative.md), its defaults cut
# to a dense model's short drafts as those docs advise: drafts of up to 16 tokens after a lookup
# as long as the engine's ngram's (4 tokens) for ngram-simple, of 8 for ngram-mod (whose pool
# of hashes all slots share, and which its docs warn against small lookups for); the draft
# model drafts 3, its default and the engine's draft_model's.
DRAFT = "{draft}"  # the Q8_0 GGUF's path, filled in by llama_flags
LLAMA_METHODS = {
    "off": (),
    "ngram-simple": ("--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "4",
                     "--spec-ngram-simple-size-m", "16"),
    "ngram-mod": ("--spec-type", "ngram-mod", "--spec-ngram-mod-n-match", "8", "--spec-ngram-mod-n-min", "2",
                  "--spec-ngram-mod-n-max", "16"),
    "draft-q8": ("--spec-type", "draft-simple", "--spec-draft-model", DRAFT, "--spec-draft-n-max", "3"),
}
TARGET = 1.3  # issue 48: the engine's output tokens/s over llama-server's speculation, at these concurrencies
TARGET_CONCURRENCIES = (1, 4)


def parse_methods(text: str, known, flag: str) -> list[str]:
    """Comma-separated names of `known`, `off` among them (every ratio needs it)."""
    methods = [m for m in text.split(",") if m]
    if not methods or any(m not in known for m in methods) or "off" not in methods:
        raise ValueError(f"{flag} {text!r}: comma-separated, `off` and any of {', '.join(k for k in known if k != 'off')}")
    return list(dict.fromkeys(methods))


def engine_parameters(method: str, checkpoint: str) -> dict[str, str]:
    """config.pbtxt parameters of the engine for `method`: the checkpoint in float32 and, unless
    off, its `speculative_config` (speculative.METHODS')."""
    parameters = {"model_path": checkpoint, "dtype": "float32"}
    if METHODS[method] is not None:
        parameters["speculative_config"] = json.dumps(METHODS[method])
    return parameters


def llama_flags(method: str, draft: str) -> list[str]:
    return [draft if flag == DRAFT else flag for flag in LLAMA_METHODS[method]]


def _ratio(a: dict, b: dict) -> dict:
    return {"output_tokens_per_s": safe_ratio(a["output_tokens_per_s"], b["output_tokens_per_s"]),
            "tpot_p50": safe_ratio(a["tpot_ms"]["p50"] or 0, b["tpot_ms"]["p50"] or 0)}


def _target(ratio: dict) -> dict:
    return {"output_tokens_per_s": TARGET, "met": ratio["output_tokens_per_s"] >= TARGET}


def _medians(ratios: list[dict]) -> dict:
    return {key: float(np.median([r[key] for r in ratios])) for key in ("output_tokens_per_s", "tpot_p50")}


def compare(results: list[dict]) -> dict:
    """The ratios of `compare_round` for a run of one round; of several (each result's
    "round"), the medians of the rounds' ratios per load, with `rounds` (how many rounds had
    that load) and, as `llama_server_best`, the speculation of llama-server's fastest in the most
    rounds. A round under way counts for the ratios it has so far."""
    by_round = compare_rounds(results)
    if len(by_round) == 1:
        return by_round[0]
    out: dict[str, dict] = {}
    for load in dict.fromkeys(load for entry in by_round for load in entry):
        entries = [entry[load] for entry in by_round if load in entry]
        merged: dict = {"rounds": len(entries), "over_off": {}}
        for system in SYSTEMS:
            theirs = [e["over_off"][system] for e in entries if system in e["over_off"]]
            methods = dict.fromkeys(m for ratios in theirs for m in ratios)
            if methods:
                merged["over_off"][system] = {m: _medians([r[m] for r in theirs if m in r]) for m in methods}
        compared = [e for e in entries if "vs_llama_server" in e]
        if compared:
            merged["llama_server_best"] = Counter(e["llama_server_best"] for e in compared).most_common(1)[0][0]
            merged["vs_llama_server"] = {}
            for method in dict.fromkeys(m for e in compared for m in e["vs_llama_server"]):
                ratios = [e["vs_llama_server"][method] for e in compared if method in e["vs_llama_server"]]
                ratio = _medians(ratios)
                if "target" in ratios[0]:
                    ratio["target"] = _target(ratio)
                merged["vs_llama_server"][method] = ratio
        out[load] = merged
    return out


def compare_rounds(results: list[dict]) -> list[dict]:
    """`compare_round` of each round the results have (their "round", 0 without one), in order."""
    rounds = sorted({r.get("round", 0) for r in results})
    return [compare_round([r for r in results if r.get("round", 0) == k]) for k in rounds]


def compare_round(results: list[dict]) -> dict:
    """Per workload and concurrency ("W9a c=1") of one round: llama-server's fastest speculation
    (`llama_server_best`), each of the engine's methods over it (`vs_llama_server`, with the
    target where the concurrency has one), and each system's methods over its own `off`
    (`over_off`)."""
    out: dict[str, dict] = {}
    for key in dict.fromkeys((r["workload"], r["concurrency"]) for r in results):
        group = [r for r in results if (r["workload"], r["concurrency"]) == key]
        runs = {system: {r["method"]: r for r in group if r["system"] == system} for system in SYSTEMS}
        entry: dict = {"over_off": {}}
        for system, by_method in runs.items():
            if "off" in by_method:
                ratios = {m: _ratio(r, by_method["off"]) for m, r in by_method.items() if m != "off"}
                if ratios:
                    entry["over_off"][system] = ratios
        theirs = {m: r for m, r in runs["llama-server"].items() if m != "off"}
        ours = {m: r for m, r in runs["tritonserver"].items() if m != "off"}
        if theirs and ours:
            best = max(theirs, key=lambda m: theirs[m]["output_tokens_per_s"])
            entry["llama_server_best"] = best
            entry["vs_llama_server"] = {}
            for method, result in ours.items():
                ratio = _ratio(result, theirs[best])
                if key[1] in TARGET_CONCURRENCIES:
                    ratio["target"] = _target(ratio)
                entry["vs_llama_server"][method] = ratio
        out[f"{key[0]} c={key[1]}"] = entry
    return out


def text_difference(texts: list[str], reference: list[str]) -> dict:
    """How `texts` differ from `reference`, request by request: how many differ, and where the
    first that differs leaves its reference (request index, character offset)."""
    differing = [i for i, (a, b) in enumerate(zip(texts, reference, strict=True)) if a != b]
    entry: dict = {"requests_differing": len(differing)}
    if differing:
        first = differing[0]
        a, b = texts[first], reference[first]
        entry["first"] = {"request": first,
                          "offset": next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))}
    return entry


def compare_texts(texts: dict[tuple[str, str, str, int], list[str]]) -> dict:
    """Per workload and concurrency, each system's methods' output texts against its own `off`,
    and llama-server's `off` against the engine's: {"W9a c=1": {"tritonserver": {"ngram": ...},
    "llama-server": {...}, "llama-server off vs tritonserver off": ...}} (text_difference's entries)."""
    out: dict[str, dict] = {}
    for workload, concurrency in dict.fromkeys((w, c) for _, _, w, c in texts):
        entry: dict = {}
        for system in SYSTEMS:
            off = texts.get((system, "off", workload, concurrency))
            if off is None:
                continue
            mine = {m: text_difference(t, off) for (s, m, w, c), t in texts.items()
                    if (s, w, c) == (system, workload, concurrency) and m != "off"}
            if mine:
                entry[system] = mine
        pair = [texts.get((system, "off", workload, concurrency)) for system in ("llama-server", "tritonserver")]
        if None not in pair:
            entry["llama-server off vs tritonserver off"] = text_difference(*pair)
        out[f"{workload} c={concurrency}"] = entry
    return out


def unrepeated(texts: list[dict]) -> list[tuple]:
    """(round index, system, method, workload, concurrency) of every run whose greedy texts are
    not the first round's: greedy decoding repeats, so none of the engine's may be here."""
    return [(k, *key) for k, by_run in enumerate(texts[1:], 1) for key, t in by_run.items() if t != texts[0].get(key)]


def engine_texts_agree(greedy: dict) -> bool:
    return all(d["requests_differing"] == 0 for entry in greedy.values()
               for d in entry.get("tritonserver", {}).values())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m client.bench.speculative_serving",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", default="1,4", help="comma-separated W9a requests in flight (closed loop)")
    parser.add_argument("--requests", type=int, default=8, help="W9a requests at each concurrency")
    parser.add_argument("--chat-requests", type=int, default=4, help="W9b requests at concurrency 1 (0: none)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--methods", default=",".join(ENGINE_METHODS),
                        help=f"the engine's methods, comma-separated, of {', '.join(METHODS)}")
    parser.add_argument("--llama-methods", default=",".join(LLAMA_METHODS),
                        help=f"llama-server's, of {', '.join(LLAMA_METHODS)}")
    parser.add_argument("--model", default=str(DEFAULT_CHECKPOINT), help="the float32 checkpoint (and tokenizer)")
    parser.add_argument("--slots", type=int, help="sequences at once (default: the highest concurrency)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="times the whole comparison runs, each server fresh, every other round in reverse "
                             "order; the ratios are the rounds' medians")
    servers.add_llama_server_arguments(parser)
    servers.add_run_arguments(parser, "w9_vs_llama_server.json")
    args = parser.parse_args(argv)

    try:
        concurrencies = parse_concurrencies(args.concurrency)
        methods = parse_methods(args.methods, METHODS, "--methods")
        llama_methods = parse_methods(args.llama_methods, LLAMA_METHODS, "--llama-methods")
        cpus = first_cpus(args.cores)
    except ValueError as exc:
        parser.error(str(exc))
    drafts = [m for m in methods if METHODS[m] is not None and METHODS[m]["method"] == "draft_model"]
    if drafts:
        parser.error(f"--methods {','.join(drafts)}: through the server a draft_model method needs a draft "
                     "checkpoint of its own; these are the in-process W9's (client/bench/speculative.py)")
    if args.requests < 1 or args.chat_requests < 0 or args.max_tokens < 1 or args.rounds < 1:
        parser.error("--requests, --max-tokens and --rounds must be at least 1, --chat-requests at least 0")
    slots = args.slots or max(concurrencies)
    if slots < max(concurrencies):
        parser.error(f"--slots {slots}: fewer than the highest concurrency, {max(concurrencies)}")
    tools = [llama_cpp.LLAMA_SERVER, *([llama_cpp.LLAMA_QUANTIZE] if "draft-q8" in llama_methods else [])]
    for tool in tools:
        if not tool.exists():
            parser.error(f"{tool} is missing: run `make peers-llama-cpp`")

    info = machine()
    path = args.json or str(REPO_ROOT / "bench" / "results" / info["cpu_kind"] / "w9_vs_llama_server.json")
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    runs = [(w9a_grounded(tokenizer, args.requests, args.max_tokens, seed=args.seed + i), c)
            for i, c in enumerate(concurrencies)]
    if args.chat_requests:
        runs.append((w9b_chat(tokenizer, args.chat_requests, args.max_tokens), 1))
    gguf = llama_cpp.convert(args.model, "float32")
    draft = llama_cpp.make_quantized_gguf(args.model, "Q8_0") if "draft-q8" in llama_methods else ""
    print(f"W9 vs llama-server: W9a at concurrency {concurrencies}"
          f"{', W9b at 1' if args.chat_requests else ''}, {args.max_tokens} tokens out, on CPUs {cpus} of "
          f"{info['cpu']}", flush=True)

    results, versions = [], {}
    texts: list[dict] = [{} for _ in range(args.rounds)]  # per round: (system, method, workload, concurrency) -> texts
    report = {
        **servers.report_header("W9 against llama-server: speculative decoding through each system's server (issue 48)",
                                "client.bench.speculative_serving", argv, info, cpus, versions, args.model),
        "gguf_files": {name: {"path": os.path.relpath(f, REPO_ROOT), "bytes": os.path.getsize(f)}
                       for name, f in (("target", gguf), ("draft", draft)) if f},
        "slots": slots,
        "engine_methods": {m: METHODS[m] for m in methods},
        "llama_methods": {m: llama_flags(m, os.path.relpath(draft, REPO_ROOT) if draft else "") for m in llama_methods},
        "llama_server_extra_args": args.llama_server_args,
        "workloads": {f"{w.name} c={c}": w.summary() for w, c in runs},
        **({"note": args.note} if args.note else {}),
        "results": results,
    }
    # A failure leaves the servers' logs in `tmp` (it says where); a run that ends removes them.
    tmp = tempfile.mkdtemp(prefix="bench-w9-llama-")
    settings = [("tritonserver", m) for m in methods] + [("llama-server", m) for m in llama_methods]
    for round_ in range(args.rounds):
        for system, method in settings if round_ % 2 == 0 else settings[::-1]:
            start = (partial(tritonserver, BASE_MODEL, engine_parameters(method, args.model), cpus, slots)
                     if system == "tritonserver" else partial(llama_server, gguf, cpus, slots,
                                                              extra=llama_flags(method, draft) + args.llama_server_args))
            label = f"{system} {method}" + (f" round {round_ + 1}" if args.rounds > 1 else "")
            with servers.started(label, system, start, tmp, versions) as address:
                target = parse_target(f"{system}=openai://{address}")
                for workload, concurrency in runs:
                    run = run_target(target, workload, concurrency, not args.no_progress, args.request_timeout)
                    texts[round_][(system, method, workload.name, concurrency)] = [r.text for r in run.records]
                    result = {"method": method, "workload": workload.name, **summarize(run, workload)}
                    if args.rounds > 1:
                        result["round"] = round_
                    results.append(result)
                    print(f"{workload.name} c={concurrency} {system} {method}"
                          f"{f' (round {round_ + 1})' if args.rounds > 1 else ''}: {result['num_completed']}/"
                          f"{result['num_requests']} completed, {result['output_tokens_per_s']:.1f} output tok/s, "
                          f"TPOT p50 {result['tpot_ms']['p50'] or 0:.1f} ms in {result['duration_s']:.1f} s", flush=True)
            # Written after each server: a run stopped halfway keeps what it measured.
            report["ratios"] = compare(results)
            if args.rounds > 1:
                report["ratios_by_round"] = compare_rounds(results)
            report["greedy_texts"] = compare_texts(texts[0])
            if args.rounds > 1:
                report["texts_differing_from_round_1"] = [f"round {k + 1}: {system} {method} {workload} c={concurrency}"
                                                          for k, system, method, workload, concurrency
                                                          in unrepeated(texts)]
            write_report(path, report)
    shutil.rmtree(tmp)

    for load, entry in report["ratios"].items():
        for method, ratio in entry.get("vs_llama_server", {}).items():
            verdict = "" if "target" not in ratio else \
                f" (target {TARGET}x: {'met' if ratio['target']['met'] else 'not met'})"
            print(f"{load}: tritonserver {method} / llama-server {entry['llama_server_best']}: "
                  f"{ratio['output_tokens_per_s']:.2f}x output tok/s, TPOT p50 {ratio['tpot_p50']:.2f}x{verdict}")
        for system, by_method in entry["over_off"].items():
            for method, ratio in by_method.items():
                print(f"{load}: {system} {method} / off: {ratio['output_tokens_per_s']:.2f}x output tok/s, "
                      f"TPOT p50 {ratio['tpot_p50']:.2f}x")
    for load, entry in report["greedy_texts"].items():
        for system in SYSTEMS:
            for method, difference in entry.get(system, {}).items():
                if difference["requests_differing"]:
                    print(f"{load}: {system} {method}'s greedy text differs from its off in "
                          f"{difference['requests_differing']} requests ({difference['first']})")
    completed = all(r["num_failed"] == 0 and r["all_token_counts_right"] for r in results)
    engine_repeats = all(system != "tritonserver" for _, system, *_ in unrepeated(texts))
    return 0 if completed and engine_repeats and all(engine_texts_agree(compare_texts(t)) for t in texts) else 1


if __name__ == "__main__":
    sys.exit(main())
