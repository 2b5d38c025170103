"""Markdown table of every benchmark result: `python -m client.bench_table [bench/results/*.json]`.

README's results section is this command's output, pasted as is.
"""

from __future__ import annotations

import glob
import json
import os
import sys

from client.bench import REPO_ROOT, format_ratio, load_label, run_label


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def table(paths: list[str]) -> str:
    lines = [
        "| workload | model | system | dtype | done | out tok/s | TTFT mean ms | TTFT p99 ms | TPOT mean ms | occupancy | preemptions | prefix hit | FLOP bound | file |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    ratios = []
    machines = set()
    for path in paths:
        with open(path) as f:
            report = json.load(f)
        machines.add(f"{report['machine']['cpu']}, {report['machine']['cores']} cores")
        name = report["workload"]["name"]
        model = os.path.basename(os.path.normpath(report.get("checkpoint", "-")))
        rel = os.path.relpath(path, REPO_ROOT)
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
            ratios.append(f"- {name} ({model}) {ratio_name}: " + format_ratio(values))
    return "\n".join(lines + [""] + ratios + ["", "Machine: " + "; ".join(sorted(machines))])


def main(argv: list[str] | None = None) -> int:
    paths = (argv if argv is not None else sys.argv[1:]) or sorted(glob.glob(os.path.join(REPO_ROOT, "bench", "results", "*.json")))
    print(table(paths))
    return 0


if __name__ == "__main__":
    sys.exit(main())
