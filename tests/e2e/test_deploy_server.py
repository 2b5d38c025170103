"""deploy/'s manifests against a running server (the session's `triton_server`, started as
`make serve` starts it, and the OpenAI frontend): every probe the pods declare answers 200,
and every metric that the endpoint picker, the HPA's adapter rule and the routers read is on
/metrics, with the labels they select on and values that mean what they expect."""

from __future__ import annotations

import time

import pytest
import requests

from tests.deploy.manifests import adapter_rules, container, epp_args, find, metric_spec, render
from tests.e2e.e2e_util import scrape
from tests.e2e.openai_frontend import run_frontend

pytestmark = pytest.mark.e2e

# Read by llm-d's endpoint picker (vLLM's names and Triton's), vLLM's production-stack router
# (gpu_cache_usage_perc) and the HPA: each with the labels they select on.
ROUTER_METRICS = [
    ("nv_trt_llm_request_metrics", {"request_type": "waiting"}),
    ("nv_trt_llm_request_metrics", {"request_type": "scheduled"}),
    ("nv_trt_llm_kv_cache_block_metrics", {"kv_cache_block_type": "fraction"}),
    ("nv_trt_llm_kv_cache_block_metrics", {"kv_cache_block_type": "tokens_per"}),
    ("nv_trt_llm_kv_cache_block_metrics", {"kv_cache_block_type": "max"}),
    ("vllm:num_requests_waiting", {}),
    ("vllm:num_requests_running", {}),
    ("vllm:kv_cache_usage_perc", {}),
    ("vllm:gpu_cache_usage_perc", {}),
    ("vllm:lora_requests_info", {"max_lora": "0", "running_lora_adapters": "", "waiting_lora_adapters": ""}),
    ("vllm:cache_config_info", {}),
]


def samples(metrics, name: str, model: str, **labels: str) -> list[tuple[dict[str, str], float]]:
    return [(ls, v) for n, ls, v in metrics.samples
            if n == name and ls.get("model") == model and all(ls.get(k) == x for k, x in labels.items())]


def test_pod_probes_answer_on_a_running_server(triton_server):
    deployment = find(render("overlays/cpu"), "Deployment", "inflight")
    triton = container(deployment, "triton")
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        path = triton[probe]["httpGet"]["path"]
        assert requests.get(triton_server.http_url + path, timeout=10).status_code == 200, probe
    frontend = container(deployment, "openai")
    with run_frontend(triton_server.grpc_url) as openai:
        path = frontend["readinessProbe"]["httpGet"]["path"]
        assert requests.get(openai.url + path, timeout=10).status_code == 200
        # The port an InferencePool routes to speaks the OpenAI API.
        listed = openai.openai().models.list()
        assert triton_server.model in [m.id for m in listed.data]
    runtime = find(render("kserve"), "ServingRuntime")
    (kserve,) = runtime["spec"]["containers"]
    for probe in ("readinessProbe", "livenessProbe"):
        assert requests.get(triton_server.http_url + kserve[probe]["httpGet"]["path"], timeout=10).status_code == 200


def test_every_metric_routers_read_is_exported_with_its_labels(triton_server):
    model = triton_server.model
    before = time.time()
    answer = requests.post(f"{triton_server.http_url}/v2/models/{model}/generate", timeout=120, json={
        "text_input": "The capital of France is", "parameters": {"temperature": 0, "max_tokens": 4}})
    assert answer.status_code == 200, answer.text
    metrics = scrape(triton_server.metrics_port)

    wanted = list(ROUTER_METRICS)
    args = epp_args(render("llm-d"))
    for flag in ("total-queued-requests-metric", "total-running-requests-metric", "kv-cache-usage-percentage-metric",
                 "lora-info-metric", "cache-info-metric"):
        wanted.append(metric_spec(args[flag]))
    for rule in adapter_rules():
        wanted.append(metric_spec(rule["seriesQuery"].split("{")[0]))
    for name, labels in wanted:
        assert len(samples(metrics, name, model, **labels)) == 1, (name, labels)

    def one(name, **labels) -> tuple[dict[str, str], float]:
        (found,) = samples(metrics, name, model, **labels)
        return found

    for name in ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc",
                 "vllm:gpu_cache_usage_perc"):
        labels, _ = one(name)
        assert labels["model_name"] == model and labels["engine"] == "0", name
    usage = one("vllm:kv_cache_usage_perc")[1]
    assert one("vllm:gpu_cache_usage_perc")[1] == usage
    assert one("nv_trt_llm_kv_cache_block_metrics", kv_cache_block_type="fraction")[1] == usage
    assert 0 <= usage <= 1
    assert one("vllm:num_requests_waiting")[1] == one("nv_trt_llm_request_metrics", request_type="waiting")[1]
    assert one("vllm:num_requests_running")[1] == one("nv_trt_llm_request_metrics", request_type="scheduled")[1]
    info, value = one("vllm:cache_config_info")
    assert value == 1
    assert float(info["block_size"]) == one("nv_trt_llm_kv_cache_block_metrics", kv_cache_block_type="tokens_per")[1]
    assert float(info["num_gpu_blocks"]) == one("nv_trt_llm_kv_cache_block_metrics", kv_cache_block_type="max")[1] > 0
    _, stamp = one("vllm:lora_requests_info")
    assert before - 1.0 <= stamp <= time.time()
