"""deploy/ rendered by the pinned kubectl and checked without a cluster: every object valid
against the Kubernetes 1.32 OpenAPI schemas or its CRD's schema, and every command, port,
probe, selector and metric name consistent with the others and with the project's servers
(tools/serve.py, client/openai). tests/e2e/test_deploy_server.py checks the same names
against a running server."""

from __future__ import annotations

import argparse
import copy
import re
from unittest import mock

import jsonschema
import kubernetes_validate
import pytest
import yaml

from backend.paths import REPO_ROOT
from tests.deploy.manifests import (
    CRD_SCHEMAS,
    DEPLOY,
    KUSTOMIZATIONS,
    adapter_rules,
    container,
    epp_args,
    find,
    metric_spec,
    port_number,
    render,
    validate,
)


@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_every_object_is_valid(kustomization):
    objects = render(kustomization)
    assert objects
    for obj in objects:
        validate(obj)


def test_the_validators_refuse_what_a_cluster_would():
    """Each validator bites: a wrong type, an unknown field, a missing required field."""
    deployment = copy.deepcopy(find(render("overlays/cpu"), "Deployment", "inflight"))
    container(deployment, "triton")["ports"][0]["containerPort"] = "eight thousand"
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(deployment)
    deployment = copy.deepcopy(find(render("overlays/cpu"), "Deployment", "inflight"))
    container(deployment, "triton")["readinessProbe"]["httpGets"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(deployment)
    pool = copy.deepcopy(find(render("llm-d"), "InferencePool"))
    pool["spec"]["targetPortz"] = pool["spec"].pop("targetPorts")
    with pytest.raises(jsonschema.ValidationError):
        validate(pool)
    monitor = copy.deepcopy(find(render("overlays/cpu"), "PodMonitor"))
    monitor["spec"]["podMetricsEndpoints"][0]["interval"] = 5
    with pytest.raises(jsonschema.ValidationError):
        validate(monitor)
    service = copy.deepcopy(find(render("kserve"), "InferenceService"))
    service["spec"]["predictor"]["model"]["modelFormat"] = {}
    with pytest.raises(jsonschema.ValidationError):
        validate(service)


def test_every_vendored_schema_is_accounted_for():
    """A kind with neither a vendored schema nor one in kubernetes-validate fails
    test_every_object_is_valid (SchemaNotFoundError); each vendored one says where it is from."""
    sources = (DEPLOY / "schemas" / "SOURCES.md").read_text()
    for file in CRD_SCHEMAS.values():
        assert (DEPLOY / "schemas" / file).exists() and f"`{file}`" in sources
    kinds = {(o["apiVersion"], o["kind"]) for k in KUSTOMIZATIONS for o in render(k)}
    assert set(CRD_SCHEMAS) <= kinds


def test_model_config_is_the_repositorys():
    """kustomize reads no file above its root: deploy/base keeps a copy of the model's config."""
    assert (DEPLOY / "base" / "config.pbtxt").read_text() == \
        (REPO_ROOT / "model_repository" / "llm" / "config.pbtxt").read_text()
    for overlay in ("overlays/cpu", "overlays/gpu"):
        objects = render(overlay)
        config_map = find(objects, "ConfigMap")
        assert config_map["data"]["config.pbtxt"] == (DEPLOY / "base" / "config.pbtxt").read_text()
        deployment = find(objects, "Deployment", "inflight")
        volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
        assert volumes["model-config"]["configMap"]["name"] == config_map["metadata"]["name"]
        for name in ("triton", "openai"):
            mounts = {m["mountPath"]: m for m in container(deployment, name)["volumeMounts"]}
            assert mounts["/models/llm/config.pbtxt"] == {"name": "model-config", "mountPath": "/models/llm/config.pbtxt",
                                                          "subPath": "config.pbtxt", "readOnly": True}


def serve_args(command: list[str]) -> argparse.Namespace:
    """What tools.serve's own command line makes of `command`: it is run up to the launch,
    which is captured instead (as tests/e2e/test_docker.py does)."""
    from tools import serve

    assert command[:3] == ["python", "-m", "tools.serve"]
    launched = {}

    def capture(*args):
        launched["args"] = args
        raise FileNotFoundError("captured")

    with mock.patch.object(serve, "launch_tritonserver", capture):
        assert serve.main(command[3:]) == 2
    repository, host, http, grpc, metrics, _log_verbose, _extra = launched["args"]
    return argparse.Namespace(model_repository=repository, host=host, http_port=http, grpc_port=grpc,
                              metrics_port=metrics)


def test_server_container_is_make_serve_on_the_declared_ports():
    deployment = find(render("overlays/cpu"), "Deployment", "inflight")
    triton = container(deployment, "triton")
    args = serve_args(triton["command"])
    assert args.host == "0.0.0.0" and args.model_repository == "/models"
    ports = {p["name"]: p["containerPort"] for p in triton["ports"]}
    assert ports == {"http": args.http_port, "grpc": args.grpc_port, "metrics": args.metrics_port}
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert port_number(triton, triton[probe]["httpGet"]["port"]) == args.http_port
    assert triton["readinessProbe"]["httpGet"]["path"] == "/v2/health/ready"
    assert triton["livenessProbe"]["httpGet"]["path"] == triton["startupProbe"]["httpGet"]["path"] == "/v2/health/live"
    # Kubernetes restarts a container its liveness probe fails: only after the startup probe
    # has passed, which allows the load 10 minutes as docker's HEALTHCHECK start period does.
    startup = triton["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 600
    spec = deployment["spec"]["template"]["spec"]
    assert spec["securityContext"]["runAsNonRoot"] and spec["securityContext"]["runAsUser"] == 1000
    shm = {v["name"]: v for v in spec["volumes"]}["dshm"]
    assert shm["emptyDir"]["medium"] == "Memory"
    assert {"name": "dshm", "mountPath": "/dev/shm"} in triton["volumeMounts"]
    assert "replicas" not in deployment["spec"]  # the HPA's


def test_openai_container_talks_to_the_pods_triton():
    from client.openai.cli import build_parser

    deployment = find(render("overlays/cpu"), "Deployment", "inflight")
    triton, frontend = container(deployment, "triton"), container(deployment, "openai")
    command = frontend["command"]
    assert command[:3] == ["python", "-m", "client.openai"]
    args = build_parser().parse_args(command[3:])
    assert args.triton_url == f"127.0.0.1:{serve_args(triton['command']).grpc_port}"
    assert args.host == "0.0.0.0" and args.model_repository == "/models"
    assert [p["containerPort"] for p in frontend["ports"]] == [args.port]
    assert frontend["readinessProbe"]["httpGet"]["path"] == "/health"
    assert port_number(frontend, frontend["readinessProbe"]["httpGet"]["port"]) == args.port
    assert port_number(frontend, frontend["livenessProbe"]["tcpSocket"]["port"]) == args.port
    assert frontend["image"] == triton["image"]


def test_service_exposes_http_grpc_openai_and_metrics():
    objects = render("overlays/cpu")
    deployment, service = find(objects, "Deployment", "inflight"), find(objects, "Service", "inflight")
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= pod_labels.items()
    names = {}
    for port in service["spec"]["ports"]:
        owners = [c for c in deployment["spec"]["template"]["spec"]["containers"]
                  if any(p["name"] == port["targetPort"] for p in c.get("ports", []))]
        assert len(owners) == 1, port
        names[port["name"]] = (port["port"], port_number(owners[0], port["targetPort"]))
    assert names == {"http": (8000, 8000), "grpc": (8001, 8001), "openai": (9000, 9000), "metrics": (8002, 8002)}


def test_cpu_and_gpu_overlays_differ_in_the_gpu_alone():
    cpu = container(find(render("overlays/cpu"), "Deployment", "inflight"), "triton")["resources"]
    gpu_deployment = find(render("overlays/gpu"), "Deployment", "inflight")
    gpu = container(gpu_deployment, "triton")["resources"]
    assert "nvidia.com/gpu" not in cpu.get("limits", {}) and "nvidia.com/gpu" not in cpu.get("requests", {})
    assert gpu["limits"]["nvidia.com/gpu"] == gpu["requests"]["nvidia.com/gpu"] == "1"
    assert cpu["requests"]["cpu"] and cpu["limits"]["memory"]
    tolerations = gpu_deployment["spec"]["template"]["spec"]["tolerations"]
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in tolerations
    # The same config.pbtxt: device auto takes the GPU when the pod has one.
    assert find(render("overlays/cpu"), "ConfigMap") == find(render("overlays/gpu"), "ConfigMap")
    assert re.search(r'key: "device", value: \{ string_value: "auto" \}', (DEPLOY / "base" / "config.pbtxt").read_text())


def test_podmonitor_scrapes_the_metrics_port():
    objects = render("overlays/cpu")
    deployment, monitor = find(objects, "Deployment", "inflight"), find(objects, "PodMonitor")
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    triton = container(deployment, "triton")
    assert port_number(triton, endpoint["port"]) == serve_args(triton["command"]).metrics_port
    assert endpoint["path"] == "/metrics"


def test_hpa_scales_the_deployment_on_the_adapters_waiting_metric():
    objects = render("overlays/cpu")
    hpa = find(objects, "HorizontalPodAutoscaler")
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "inflight"}
    (metric,) = hpa["spec"]["metrics"]
    assert metric["type"] == "Pods"
    (rule,) = adapter_rules()
    assert metric["pods"]["metric"]["name"] == rule["name"]["as"]
    assert re.fullmatch(rule["name"]["matches"], "vllm:num_requests_waiting")
    name, _ = metric_spec(rule["seriesQuery"].split("{")[0])
    assert name == "vllm:num_requests_waiting"
    assert rule["resources"]["overrides"] == {"namespace": {"resource": "namespace"}, "pod": {"resource": "pod"}}


def test_inference_pool_routes_to_the_openai_port_and_its_picker():
    pods = find(render("overlays/cpu"), "Deployment", "inflight")
    objects = render("llm-d")
    pool = find(objects, "InferencePool")
    assert pool["spec"]["selector"]["matchLabels"].items() <= pods["spec"]["template"]["metadata"]["labels"].items()
    frontend = container(pods, "openai")
    assert [p["number"] for p in pool["spec"]["targetPorts"]] == [frontend["ports"][0]["containerPort"]]
    picker = find(objects, "Service", pool["spec"]["endpointPickerRef"]["name"])
    assert pool["spec"]["endpointPickerRef"]["port"]["number"] in {p["port"] for p in picker["spec"]["ports"]}
    epp = find(objects, "Deployment", "inflight-epp")
    assert picker["spec"]["selector"].items() <= epp["spec"]["template"]["metadata"]["labels"].items()
    args = epp_args(objects)
    assert args["pool-name"] == pool["metadata"]["name"]
    assert int(args["grpc-port"]) == pool["spec"]["endpointPickerRef"]["port"]["number"]
    # Metrics come from Triton's port, not the routed one.
    assert int(args["model-server-metrics-port"]) == serve_args(container(pods, "triton")["command"]).metrics_port
    assert args["config-file"].startswith("/config/")
    config_map = find(objects, "ConfigMap")
    volumes = {v["name"]: v for v in epp["spec"]["template"]["spec"]["volumes"]}
    assert volumes["config"]["configMap"]["name"] == config_map["metadata"]["name"]
    config = yaml.safe_load(config_map["data"][args["config-file"].removeprefix("/config/")])
    assert config["kind"] == "EndpointPickerConfig"
    declared = {p["type"] for p in config["plugins"]}
    for profile in config["schedulingProfiles"]:
        assert {p["pluginRef"] for p in profile["plugins"]} <= declared


def test_httproute_sends_the_frontends_openai_paths_to_the_pool():
    from client.openai.app import create_app
    from client.openai.settings import Settings

    objects = render("llm-d")
    route, pool = find(objects, "HTTPRoute"), find(objects, "InferencePool")
    (rule,) = route["spec"]["rules"]
    assert rule["backendRefs"] == [{"group": "inference.networking.k8s.io", "kind": "InferencePool",
                                    "name": pool["metadata"]["name"]}]
    (match,) = rule["matches"]
    prefix = match["path"]["value"]
    assert match["path"]["type"] == "PathPrefix"
    served = {route.path for route in create_app(Settings()).routes}
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/models"):
        assert path in served and path.startswith(prefix + "/")


def test_epp_reads_the_metrics_the_model_server_protocol_names():
    """Gateway API Inference Extension's model server protocol: for a Triton server these
    specifications; the test in tests/e2e/test_deploy_server.py finds each on a live server."""
    args = epp_args(render("llm-d"))
    assert metric_spec(args["total-queued-requests-metric"]) == ("nv_trt_llm_request_metrics", {"request_type": "waiting"})
    assert metric_spec(args["total-running-requests-metric"]) == ("nv_trt_llm_request_metrics", {"request_type": "scheduled"})
    assert metric_spec(args["kv-cache-usage-percentage-metric"]) == (
        "nv_trt_llm_kv_cache_block_metrics", {"kv_cache_block_type": "fraction"})
    assert metric_spec(args["lora-info-metric"]) == ("vllm:lora_requests_info", {})
    assert metric_spec(args["cache-info-metric"]) == ("vllm:cache_config_info", {})


def test_kserve_runtime_is_make_serve_on_kserves_ports():
    objects = render("kserve")
    runtime, service = find(objects, "ServingRuntime"), find(objects, "InferenceService")
    model = service["spec"]["predictor"]["model"]
    assert model["runtime"] == runtime["metadata"]["name"]
    assert model["modelFormat"]["name"] in {f["name"] for f in runtime["spec"]["supportedModelFormats"]}
    assert model["protocolVersion"] in runtime["spec"]["protocolVersions"]
    (server,) = runtime["spec"]["containers"]
    assert server["name"] == "kserve-container"  # the name KServe fills in and routes to
    args = serve_args(server["command"])
    assert args.model_repository == "/mnt/models"  # where KServe's storage initializer puts storageUri
    assert [p["containerPort"] for p in server["ports"]] == [args.http_port] == [8080]
    assert server["readinessProbe"]["httpGet"] == {"path": "/v2/health/ready", "port": args.http_port}
    assert runtime["metadata"]["annotations"]["prometheus.kserve.io/port"] == str(args.metrics_port)
    assert model["storageUri"].startswith("pvc://")


def test_every_image_is_the_dockerfiles():
    compose_image = "inflight:latest"  # docker/compose.yaml's name for the image docker/Dockerfile builds
    for kustomization in ("overlays/cpu", "overlays/gpu", "kserve"):
        for obj in render(kustomization):
            spec = obj.get("spec", {})
            pod = spec.get("template", {}).get("spec", spec)
            for c in pod.get("containers", []):
                assert c["image"] == compose_image, (kustomization, c["name"])
