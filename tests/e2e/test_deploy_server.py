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



def test_after_its_final_response_a_client_finds_its_request_on_metrics(triton_server):
    """Families that routers compare carry the same step once a request has its final
    response: the model applies a step's metric updates before the step's final responses.
    Applied after them, a scrape right after a response saw vllm:num_requests_running at 0
    beside TensorRT-LLM's scheduled count at 1, or the pool's usage in one family and not the
    next: in 10 of 60 tries with the engine on both cores, and within 100 on this server."""
    model = triton_server.model
    for i in range(100):
        answer = requests.post(f"{triton_server.http_url}/v2/models/{model}/generate", timeout=120, json={
            "text_input": f"Count to {i}:", "parameters": {"temperature": 0, "max_tokens": 4}})
        assert answer.status_code == 200, answer.text
        metrics = scrape(triton_server.metrics_port)

        def value(name, **labels) -> float:
            (found,) = samples(metrics, name, model, **labels)
            return found[1]

        assert value("vllm:num_requests_running") == value("nv_trt_llm_request_metrics", request_type="scheduled"), i
        assert value("vllm:num_requests_waiting") == value("nv_trt_llm_request_metrics", request_type="waiting"), i
        usage = value("vllm:kv_cache_usage_perc")
        assert value("vllm:gpu_cache_usage_perc") == usage, i
        assert value("nv_trt_llm_kv_cache_block_metrics", kv_cache_block_type="fraction") == usage, i


def prometheus_query(url: str, promql: str) -> list[dict]:
    answer = requests.get(f"{url}/api/v1/query", params={"query": promql}, timeout=10).json()
    assert answer["status"] == "success", answer
    return answer["data"]["result"]


def test_hpa_adapter_rule_reads_the_queue_through_a_real_prometheus(triton_server, tmp_path):
    """Prometheus (Debian's 2.42, `make deploy-prometheus`) scrapes the server as the PodMonitor
    says (its path, the pod's namespace and pod labels that prometheus-operator attaches), and
    the prometheus-adapter rule's series and metrics queries, filled in as the adapter fills
    them for one pod, find the pod and follow its waiting queue: 0 idle, above 0 while more
    requests arrive than the engine runs at once (E2E max_num_seqs 8)."""
    import shutil
    import subprocess
    from concurrent.futures import ThreadPoolExecutor

    from tools.launch import free_ports

    if shutil.which("prometheus") is None:
        made = subprocess.run(["make", "-s", "deploy-prometheus"], capture_output=True, text=True, timeout=600)
        assert made.returncode == 0, f"make deploy-prometheus failed:\n{made.stdout}\n{made.stderr}"
    (endpoint,) = find(render("overlays/cpu"), "PodMonitor")["spec"]["podMetricsEndpoints"]
    (rule,) = adapter_rules()
    namespace, pod = "inflight-test", "inflight-7d9f-abcde"
    (port,) = free_ports(1)
    (tmp_path / "prometheus.yml").write_text(
        "global: {scrape_interval: 1s}\n"
        "scrape_configs:\n"
        f"  - job_name: inflight\n    metrics_path: {endpoint['path']}\n"
        f"    static_configs: [{{targets: ['127.0.0.1:{triton_server.metrics_port}'],"
        f" labels: {{namespace: {namespace}, pod: {pod}}}}}]\n")
    log = open(tmp_path / "prometheus.log", "w")
    proc = subprocess.Popen(["prometheus", f"--config.file={tmp_path / 'prometheus.yml'}",
                             f"--storage.tsdb.path={tmp_path / 'data'}", f"--web.listen-address=127.0.0.1:{port}"],
                            stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if prometheus_query(url, 'up{job="inflight"} == 1'):
                    break
            except requests.ConnectionError:
                pass
            assert time.monotonic() < deadline, (tmp_path / "prometheus.log").read_text()[-2000:]
            time.sleep(0.5)

        series = requests.get(f"{url}/api/v1/series", params={"match[]": rule["seriesQuery"]}, timeout=10).json()["data"]
        assert series and all(s["namespace"] == namespace and s["pod"] == pod for s in series), series
        assert {s["__name__"] for s in series} == {"vllm:num_requests_waiting"}
        # As the adapter fills the template for one pod's metric.
        query = (rule["metricsQuery"].replace("<<.Series>>", series[0]["__name__"])
                 .replace("<<.LabelMatchers>>", f'namespace="{namespace}",pod=~"{pod}"').replace("<<.GroupBy>>", "pod"))

        def waiting() -> float:
            (result,) = prometheus_query(url, query)
            assert result["metric"] == {"pod": pod}
            return float(result["value"][1])

        assert waiting() == 0
        # 8 run, 8 wait while the first 8 generate 160 tokens: seconds, against a 1 s scrape.
        body = {"text_input": "Count slowly:", "parameters": {"temperature": 0, "max_tokens": 160, "ignore_eos": True}}

        def one(_i):
            return requests.post(f"{triton_server.http_url}/v2/models/{triton_server.model}/generate", json=body,
                                 timeout=300).status_code

        seen = 0.0
        with ThreadPoolExecutor(16) as pool:
            answers = pool.map(one, range(16))
            deadline = time.monotonic() + 60
            while seen == 0 and time.monotonic() < deadline:
                seen = max(seen, waiting())
                time.sleep(0.5)
            assert list(answers) == [200] * 16
        assert seen > 0, "the adapter's query never saw a request waiting"
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()
