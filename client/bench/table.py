"""Tables of benchmark reports: the console table `python -m client.bench` prints, and the
markdown tables of every result, `python -m client.bench.table [bench/results/KIND/*.json]`.

One section per machine kind (the report's `cpu_kind`: avx2, avx512_bf16, amx), so that no
table or ratio mixes kinds. In each, client.bench reports go in one table, genai-perf reports
(`client.bench.loadtest genai-perf --json`) in a second: genai-perf measures other things
(inter-token latency, no occupancy or FLOP bound). README's results section is this command's
output, pasted as is.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
from pathlib import Path

from backend.paths import REPO_ROOT
from client.bench.stats import DEFAULT_SLO, format_ratio, load_label, run_label


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def print_table(report: dict) -> None:
    with_load = any(load_label(r) for r in report["results"])
    with_run = any(run_label(r) for r in report["results"])
    columns = ["system", *(["load"] if with_load else []), *(["run"] if with_run else []), "done", "out tok/s", "goodput", "TTFT mean", "TTFT p99",
               "TPOT mean", "TPOT p99", "occupancy", "preempt", "prefix hit", "FLOP bound"]
    rows = []
    for r in report["results"]:
        rows.append([
            r["system"], *([load_label(r)] if with_load else []), *([str(r["run"])] if with_run else []),
            f"{r['num_completed']}/{r['num_requests']}",
            _fmt(r["output_tokens_per_s"], ".1f"), _fmt(r.get("goodput_requests_per_s"), ".2f"),
            _fmt(r["ttft_ms"]["mean"], ".0f"), _fmt(r["ttft_ms"]["p99"], ".0f"),
            _fmt(r["tpot_ms"]["mean"], ".1f"), _fmt(r["tpot_ms"]["p99"], ".1f"),
            _fmt(r.get("slot_occupancy"), ".2f"), str(r.get("preemptions", "-")), _fmt(r.get("prefix_hit_rate"), ".2f"),
            _fmt(r.get("fraction_of_flop_bound"), ".1%"),
        ])
    widths = [max(len(str(x)) for x in col) for col in zip(columns, *rows)]
    machine = report["machine"]
    print(f"\n{report['workload']['name']}: {report['workload']['description']}  "
          f"({machine['cpu']}, {machine['cores']} cores{_gpu_suffix(report)})")
    print("  ".join(c.ljust(w) for c, w in zip(columns, widths)))
    for row in rows:
        print("  ".join(str(x).ljust(w) for x, w in zip(row, widths)))
    for name, ratio in report["ratios"].items():
        print(f"ratio {name}: " + format_ratio(ratio))
    slo = report.get("slo", DEFAULT_SLO)
    print(f"(TTFT/TPOT in ms; goodput: requests/s with TTFT <= {slo['ttft_ms']:g} ms and TPOT <= {slo['tpot_ms']:g} ms)")
    for r in report["results"]:
        for error in r.get("errors", []):
            print(f"{r['system']} {load_label(r)}: error: {error}")


def tables(paths: list[str]) -> str:
    """A section per machine kind, the kinds in their order of first appearance (`machine_kind`).
    Reports of another shape (the cluster's routing runs, soaks, the sampler's micro-benchmark: no
    workload or genai-perf run per system) are left to their own sections of the README."""
    by_kind: dict[str, list[str]] = {}
    for path in paths:
        with open(path) as f:
            report = json.load(f)
        per_system = "workload" in report or report.get("tool", "").startswith("genai-perf")
        if per_system and isinstance(report.get("results"), list):
            by_kind.setdefault(machine_kind(report), []).append(path)
    return "\n\n".join(f"#### Machine kind: {kind}\n\n{table(kind_paths)}" for kind, kind_paths in by_kind.items())


def _gpu_suffix(report: dict) -> str:
    """", NAME" for a report whose engine ran on a GPU, else nothing."""
    return f", {report['machine'].get('gpu', 'unknown')}" if report.get("device") == "cuda" else ""


def machine_kind(report: dict) -> str:
    """The CPU's kind (`cpu_kind`), or for an engine that ran on a GPU, the GPU: a GPU run
    shares nothing with the CPU runs of its host's kind."""
    machine = report["machine"]
    if report.get("device") == "cuda":
        return f"gpu ({machine.get('gpu', 'unknown')})"
    return machine.get("cpu_kind", "unknown")


def table(paths: list[str]) -> str:
    lines = [
        "| workload | model | system | dtype | done | out tok/s | TTFT mean ms | TTFT p99 ms | TPOT mean ms | occupancy | preemptions | prefix hit | FLOP bound | file |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    genai_lines = [
        "| tool | model | system | concurrency | out tok/s | TTFT mean ms | TTFT p99 ms | ITL mean ms | ITL p99 ms | file |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    ratios = []
    machines = set()
    for path in paths:
        with open(path) as f:
            report = json.load(f)
        flags = report["machine"].get("cpu_flags")
        machines.add(f"{report['machine']['cpu']}, {report['machine']['cores']} cores"
                     + (f" ({' '.join(flags)})" if flags else "")
                     + _gpu_suffix(report))
        rel = os.path.relpath(path, REPO_ROOT)
        if report.get("tool", "").startswith("genai-perf"):
            model = os.path.basename(os.path.normpath(report["recipe"]["tokenizer"]))
            for r in report["results"]:
                ttft, itl = r["time_to_first_token"], r["inter_token_latency"]
                system = r["system"] + (f" @ run {r['run']}" if "run" in r else "")
                genai_lines.append(
                    f"| {report['tool']} | {model} | {system} | {r['concurrency']} | "
                    f"{r['output_token_throughput']['avg']:.1f} | {ttft['avg']:.0f} | {ttft['p99']:.0f} | "
                    f"{itl['avg']:.1f} | {itl['p99']:.1f} | [{os.path.basename(path)}]({rel}) |"
                )
            for ratio_name, values in report["ratios"].items():
                ratios.append(f"- genai-perf ({model}, {Path(path).stem}) {ratio_name}: " + format_ratio(values))
            continue
        name = report["workload"]["name"]
        model = os.path.basename(os.path.normpath(report.get("checkpoint", "-")))
        for r in report["results"]:
            where = ", ".join(filter(None, [load_label(r), run_label(r)]))
            lines.append(
                f"| {name} | {model} | {r['system']}{' @ ' + where if where else ''} | {r.get('dtype', '-')} | {r['num_completed']}/{r['num_requests']} | "
                f"{_fmt(r['output_tokens_per_s'], '.1f')} | {_fmt(r['ttft_ms']['mean'], '.0f')} | "
                f"{_fmt(r['ttft_ms']['p99'], '.0f')} | {_fmt(r['tpot_ms']['mean'], '.1f')} | "
                f"{_fmt(r.get('slot_occupancy'), '.2f')} | {r.get('preemptions', '-')} | "
                f"{_fmt(r.get('prefix_hit_rate'), '.2f')} | {_fmt(r.get('fraction_of_flop_bound'), '.1%')} | "
                f"[{os.path.basename(path)}]({rel}) |"
            )
        for ratio_name, values in report.get("ratios", {}).items():
            dtype = next((r["dtype"] for r in report["results"] if r.get("dtype")), "-")
            ratios.append(f"- {name} ({model}, {dtype}) {ratio_name}: " + format_ratio(values))
    tables = [rows for rows in (lines, genai_lines) if len(rows) > 2]
    tables = [line for rows in tables for line in rows + [""]]
    return "\n".join(tables + ratios + ["", "Machine: " + "; ".join(sorted(machines))])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m client.bench.table",
        description="Markdown tables of benchmark reports, one section per machine kind.")
    parser.add_argument("reports", nargs="*", metavar="REPORT.json",
                        help="reports to table (default: every bench/results/*/*.json)")
    args = parser.parse_args(argv)
    paths = args.reports or sorted(glob.glob(os.path.join(REPO_ROOT, "bench", "results", "*", "*.json")))
    print(tables(paths))
    return 0


if __name__ == "__main__":
    sys.exit(main())
