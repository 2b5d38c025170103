"""deploy/'s kustomizations, rendered by the pinned kubectl (`make deploy-tools`), and the
schemas every rendered object is validated against.

Built-in kinds: the Kubernetes OpenAPI schemas of KUBERNETES_VERSION shipped in the pinned
`kubernetes-validate` package, strict (an unknown field is an error). Custom resources: the
CRD schemas vendored in deploy/schemas/ (deploy/schemas/SOURCES.md says where each is from),
strict as well. Nothing is downloaded at test time.
"""

from __future__ import annotations

import functools
import json
import re
import subprocess
from pathlib import Path

import yaml

from backend.paths import REPO_ROOT

DEPLOY = REPO_ROOT / "deploy"
SCHEMAS = DEPLOY / "schemas"
KUBECTL = REPO_ROOT / ".deploy-tools" / "bin" / "kubectl"
KUSTOMIZATIONS = ("overlays/cpu", "overlays/gpu", "kserve", "llm-d")
# The kubectl that renders (1.32.3) and the API version objects are checked against.
KUBERNETES_VERSION = "1.32.0"

# (apiVersion, kind) -> vendored schema file: a JSON schema, or a CRD whose openAPIV3Schema is used.
CRD_SCHEMAS = {
    ("monitoring.coreos.com/v1", "PodMonitor"): "monitoring.coreos.com_podmonitor_v1.json",
    ("serving.kserve.io/v1beta1", "InferenceService"): "serving.kserve.io_inferenceservice_v1beta1.json",
    ("serving.kserve.io/v1alpha1", "ServingRuntime"): "serving.kserve.io_servingruntime_v1alpha1.json",
    ("inference.networking.k8s.io/v1", "InferencePool"): "inference.networking.k8s.io_inferencepools.yaml",
    ("gateway.networking.k8s.io/v1", "HTTPRoute"): "gateway.networking.k8s.io_httproute_v1.json",
}


def kubectl() -> Path:
    if not KUBECTL.exists():
        made = subprocess.run(["make", "-s", "deploy-tools"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
        assert made.returncode == 0, f"make deploy-tools failed:\n{made.stdout}\n{made.stderr}"
    return KUBECTL


@functools.cache
def render(kustomization: str) -> tuple[dict, ...]:
    """The objects `kubectl kustomize deploy/<kustomization>` renders."""
    out = subprocess.run([str(kubectl()), "kustomize", str(DEPLOY / kustomization)], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, f"kubectl kustomize deploy/{kustomization}:\n{out.stderr}"
    return tuple(doc for doc in yaml.safe_load_all(out.stdout) if doc)


def find(objects, kind: str, name: str | None = None) -> dict:
    found = [o for o in objects if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]
    assert len(found) == 1, f"{len(found)} {kind} {name or ''} objects"
    return found[0]


def container(deployment: dict, name: str) -> dict:
    (found,) = [c for c in deployment["spec"]["template"]["spec"]["containers"] if c["name"] == name]
    return found


def port_number(container_: dict, port) -> int:
    """A probe's or Service's port (a number or a container port's name) as a number."""
    if isinstance(port, int):
        return port
    (number,) = [p["containerPort"] for p in container_["ports"] if p["name"] == port]
    return number


def _strict(schema):
    """A CRD schema as the API server applies it: fields it does not declare are refused
    (unless it says x-kubernetes-preserve-unknown-fields)."""
    if isinstance(schema, dict):
        schema = {k: _strict(v) for k, v in schema.items()}
        if "properties" in schema and "additionalProperties" not in schema \
                and not schema.get("x-kubernetes-preserve-unknown-fields"):
            schema["additionalProperties"] = False
        return schema
    if isinstance(schema, list):
        return [_strict(v) for v in schema]
    return schema


@functools.cache
def crd_schema(api_version: str, kind: str) -> dict:
    path = SCHEMAS / CRD_SCHEMAS[(api_version, kind)]
    if path.suffix == ".json":
        return json.loads(path.read_text())
    crd = yaml.safe_load(path.read_text())
    version = api_version.split("/")[1]
    (served,) = [v for v in crd["spec"]["versions"] if v["name"] == version]
    return _strict(served["schema"]["openAPIV3Schema"])


def validate(obj: dict) -> None:
    """Raise (jsonschema's or kubernetes_validate's ValidationError) unless `obj` is valid."""
    import jsonschema
    import kubernetes_validate

    key = (obj["apiVersion"], obj["kind"])
    if key in CRD_SCHEMAS:
        jsonschema.Draft7Validator(crd_schema(*key)).validate(obj)
    else:
        kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)


def metric_spec(spec: str) -> tuple[str, dict[str, str]]:
    """The endpoint picker's metric specification, `name` or `name{label=value,...}`, read as
    the picker reads it: values are taken literally, quotes and all."""
    match = re.fullmatch(r"([A-Za-z_:][A-Za-z0-9_:]*)(?:\{(.*)\})?", spec)
    assert match, spec
    labels = dict(pair.split("=", 1) for pair in match.group(2).split(",")) if match.group(2) else {}
    return match.group(1), {k.strip(): v.strip() for k, v in labels.items()}


def epp_args(objects) -> dict[str, str]:
    args = container(find(objects, "Deployment", "inflight-epp"), "epp")["args"]
    return dict(arg.removeprefix("--").split("=", 1) for arg in args)


def adapter_rules() -> list[dict]:
    return yaml.safe_load((DEPLOY / "prometheus-adapter" / "values.yaml").read_text())["rules"]["custom"]
