"""Plots of a benchmark report: `python -m client.bench.plot bench/results/w3.json [-o out.png]`.

A rate sweep (several arrival rates) gives latency-throughput curves: TTFT p99 and TPOT
p99 against the output tokens/s each rate achieved, one line per system; where a curve
turns up is the system's capacity. Any other report gives bars: output tokens/s and TTFT
p99 per system (per system and load when there are several). A report whose results hold
each tenant's service over time (W8) adds a row: per system, each tenant's cumulative
service (input tokens x input cost + output tokens x output cost) against time. `python
-m client.bench --plot` draws the same as it writes the JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from backend.paths import REPO_ROOT
from client.bench.stats import load_label, run_label


def plot_path(json_path: str | None, workload: str) -> str:
    """bench/<kind>/<json stem>.png for a report under bench/results/<kind>/ (bench/<stem>.png
    for one under bench/results/), else beside the JSON."""
    if not json_path:
        return os.path.join(REPO_ROOT, "bench", f"{workload.lower()}.png")
    folder, name = os.path.split(os.path.abspath(json_path))
    parent, kind = os.path.split(folder)
    if kind == "results":
        folder = parent
    elif os.path.basename(parent) == "results":
        folder = os.path.join(os.path.dirname(parent), kind)
    return os.path.join(folder, os.path.splitext(name)[0] + ".png")


def is_rate_sweep(report: dict) -> bool:
    rates = {r.get("rate_per_s") for r in report["results"] if not r.get("concurrency")}
    return len(rates - {None}) > 1


def _title(report: dict) -> str:
    machine = report.get("machine", {})
    where = machine.get("gpu") or f"{machine.get('cpu', '?')}, {machine.get('cores', '?')} cores"
    return f"{report['workload']['name']}: {report['workload']['description']}\n{where}"


def plot_report(report: dict, path: str) -> str:
    """Draw `report` into the PNG at `path`; returns the path."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on a server
    import matplotlib.pyplot as plt

    results = report["results"]
    timelines = [r for r in results if len(r.get("service_timeline", {})) > 2]  # t_s and 2+ tenants
    if timelines:
        fig, axes = plt.subplots(2, max(2, len(timelines)), figsize=(max(12, 4.5 * len(timelines)), 9.6),
                                 squeeze=False)
        left, right = axes[0][0], axes[0][1]
        for axis in axes[0][2:]:
            axis.set_visible(False)
        for axis, r in zip(axes[1], timelines):
            _plot_service(axis, r)
        for axis in axes[1][len(timelines):]:
            axis.set_visible(False)
    else:
        fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.8))
    if is_rate_sweep(report):
        def curve(r: dict) -> str:  # one curve per system and run
            return " ".join(filter(None, [r["system"], run_label(r)]))

        for name in dict.fromkeys(map(curve, results)):
            points = sorted((r for r in results if curve(r) == name), key=lambda r: r["output_tokens_per_s"])
            x = [r["output_tokens_per_s"] for r in points]
            for axis, metric in ((left, "ttft_ms"), (right, "tpot_ms")):
                y = [r[metric]["p99"] if r[metric]["p99"] is not None else float("nan") for r in points]
                axis.plot(x, y, marker="o", label=name)
                for xi, yi, r in zip(x, y, points):
                    axis.annotate(load_label(r), (xi, yi), textcoords="offset points", xytext=(4, 4), fontsize=7)
        slo = report.get("slo", {})
        for axis, metric, name in ((left, "ttft_ms", "TTFT"), (right, "tpot_ms", "TPOT")):
            highest = max((r[metric]["p99"] or 0 for r in results), default=0)
            if metric in slo and highest >= slo[metric] / 4:  # far above every point it would flatten the curves
                axis.axhline(slo[metric], color="grey", linestyle="--", linewidth=0.8, label=f"SLO {slo[metric]:g} ms")
            axis.set_xlabel("achieved output tokens/s")
            axis.set_ylabel(f"{name} p99 (ms)")
            axis.set_title(f"{name} p99 vs throughput (labels: offered rate)")
            axis.grid(True, alpha=0.3)
            axis.legend()
    else:
        labels = ["\n".join(filter(None, [r["system"], load_label(r), run_label(r)])) for r in results]
        left.bar(labels, [r["output_tokens_per_s"] for r in results], color="tab:blue")
        left.set_ylabel("output tokens/s")
        left.set_title("throughput")
        right.bar(labels, [r["ttft_ms"]["p99"] or 0 for r in results], color="tab:orange")
        right.set_ylabel("TTFT p99 (ms)")
        right.set_title("time to first token, p99")
        for axis in (left, right):
            axis.grid(True, axis="y", alpha=0.3)
            axis.tick_params(axis="x", labelsize=8)
    fig.suptitle(_title(report), fontsize=9)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _plot_service(axis, result: dict) -> None:
    timeline = result["service_timeline"]
    for tenant, values in sorted(timeline.items()):
        if tenant != "t_s":
            axis.plot(timeline["t_s"], values, label=tenant)
    axis.set_xlabel("time (s)")
    axis.set_ylabel("cumulative service (weighted tokens)")
    axis.set_title(f"{result['system']}: service per tenant")
    axis.grid(True, alpha=0.3)
    axis.legend(fontsize=7)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m client.bench.plot", description=__doc__.splitlines()[0])
    parser.add_argument("report", help="a report written by python -m client.bench --json")
    parser.add_argument("-o", "--output", help="PNG to write (default: bench/<json stem>.png)")
    args = parser.parse_args(argv)
    with open(args.report) as f:
        report = json.load(f)
    path = plot_report(report, args.output or plot_path(args.report, report["workload"]["name"]))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
