"""client.bench.sampling: the report's shape, on a small vocabulary."""

from __future__ import annotations

import json

from client.bench import sampling


def test_the_sampling_bench_reports_every_parameter_set_and_both_nucleus_paths(tmp_path):
    out = tmp_path / "sampler.json"
    report = sampling.main(["--rows", "3", "--vocab", "500", "--repeat", "2", "--json", str(out)])
    assert json.loads(out.read_text()) == report
    results = report["results"]
    assert set(results["sampler_ms"]) == set(sampling.PARAMETER_SETS)
    assert all(ms > 0 for ms in results["sampler_ms"].values())
    assert len(results["nucleus_ms"]) == 2 and results["nucleus_speedup"] > 0
    assert report["machine"]["cpu"] and report["rows"] == 3 and report["vocab"] == 500
