#!/usr/bin/env bash
# Wheels for a GPU machine that reaches no package index: the project's Python packages its
# image lacks (an NVIDIA PyTorch image has torch, triton, numpy, safetensors, tokenizers and
# pytest), at the versions this checkout's .venv runs, built for that machine's Python, plus
# the default tokenizer's files. Into .gpu/ (git-ignored), which a device run carries.
#
#   bash client/bench/scripts/device_wheels.sh [PYTHON_VERSION]        (default 3.12)
#
# On the device machine, before client/bench/scripts/gpu_checks.sh or client/bench/scripts/amx_checks.sh:
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .gpu/*.whl
#   export PYTHONPATH=/tmp/site:$PWD
#   mkdir -p .models/SmolLM2-135M-Instruct && cp .gpu/tok/* .models/SmolLM2-135M-Instruct/
#   export INFLIGHT_GIT_COMMIT=<this checkout's HEAD>   (the copy there has a stale git directory)
set -eu
pyv=${1:-3.12}
root=$(cd "$(dirname "$0")/../../.." && pwd)
venv_py="$root/.venv/bin/python"
dest="$root/.gpu"
packages="transformers pydantic pydantic-core annotated-types typing-inspection xgrammar apache-tvm-ffi pyzmq msgspec
hypothesis attrs sortedcontainers"
mkdir -p "$dest/tok"
pins=$("$venv_py" -c "import sys, importlib.metadata as m; print(' '.join(f'{p}=={m.version(p)}' for p in sys.argv[1:]))" $packages)
# shellcheck disable=SC2086  # one argument per pin
"$venv_py" -m pip download -q --no-deps --only-binary=:all: --python-version "$pyv" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$dest" $pins
for name in tokenizer.json tokenizer_config.json chat_template.jinja; do
    cp "$root/.models/SmolLM2-135M-Instruct/$name" "$dest/tok/"
done
ls "$dest"
