"""Reading a server's Prometheus text exposition (Triton's /metrics): the samples, and sums of
one family's samples that carry given labels. The soak run, the cluster and W10 benchmarks
and the end-to-end tests read their servers' engines through it."""

from __future__ import annotations

import re
import urllib.request

_SAMPLE = re.compile(r'^([A-Za-z_:][A-Za-z0-9_:]*)(?:\{(.*)\})?\s+(\S+)$')
_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')

Sample = tuple[str, dict[str, str], float]


def parse_metrics(text: str) -> list[Sample]:
    samples = []
    for line in text.splitlines():
        match = None if line.startswith("#") else _SAMPLE.match(line)
        if match:
            name, labels, value = match.groups()
            samples.append((name, dict(_LABEL.findall(labels or "")), float(value)))
    return samples


def read_metrics(url: str, timeout: float = 30.0) -> list[Sample]:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return parse_metrics(resp.read().decode())


def metric_sum(samples: list[Sample], family: str, **labels: str) -> float:
    """The sum of `family`'s samples whose labels include `labels` (0 when there is none)."""
    return sum(value for name, sample_labels, value in samples
               if name == family and all(sample_labels.get(k) == v for k, v in labels.items()))
