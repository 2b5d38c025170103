#!/usr/bin/env bash
# The GPU checks of one session on one NVIDIA GPU: the CUDA tests (Triton kernels in every
# dtype, the engine's greedy tokens against transformers under every scheduling feature),
# then docs/benchmarks.md's G1 (decode roofline) on a random-weight Llama-3.2-1B-shaped
# checkpoint, G2 (paged attention at Llama-3-8B's heads) and G3 (W2 at GPU size) on that
# checkpoint against transformers' continuous batching on the same GPU.
#
#   bash client/bench/scripts/gpu_checks.sh OUT_DIR [PYTHON]
#
# Writes OUT_DIR/gpu_tests.log, gpu_tests.xml, and g1, g2 and g3 .json and .log. Each step
# has its own time limit (TESTS_TIMEOUT, G1_TIMEOUT, G2_TIMEOUT, G3_TIMEOUT seconds), so a
# step that hangs costs only its share of a short GPU lease. G3_SYSTEMS picks G3's systems
# (transformers' alone took 150 s of an H200). Needs the project's Python packages and the
# default checkpoint's tokenizer (`make setup`, or client/bench/scripts/device_wheels.sh's .gpu/ on a
# machine without a package index), which the random checkpoints copy.
set -u
out=${1:?usage: bash client/bench/scripts/gpu_checks.sh OUT_DIR [PYTHON]}
py=${2:-python3}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
"$py" -c "import sys, torch, triton, transformers; print('python', sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"

start=$SECONDS
timeout "${TESTS_TIMEOUT:-200}" "$py" -m pytest -q -p no:cacheprovider -m "not slow" -k cuda --junitxml="$out/gpu_tests.xml" \
    tests/kernels/test_kernels_cuda.py tests/unit/test_sampler_cuda.py tests/engine/test_engine_equivalence.py >"$out/gpu_tests.log" 2>&1
echo "tests: exit $? in $((SECONDS - start)) s"; tail -25 "$out/gpu_tests.log"

start=$SECONDS
ckpt=${GPU_CHECKPOINT:-/tmp/random-llama3-1b}
"$py" -m tools.random_checkpoint "$ckpt" --shape llama3-1b --dtype bfloat16 >/dev/null 2>&1 || echo "checkpoint failed"
echo "checkpoint in $((SECONDS - start)) s"

start=$SECONDS
timeout "${G1_TIMEOUT:-120}" "$py" -m client.bench.roofline --model "$ckpt" --device cuda --dtype bfloat16 \
    --json "$out/g1.json" >"$out/g1.log" 2>&1
echo "G1: exit $? in $((SECONDS - start)) s"; tail -12 "$out/g1.log"

start=$SECONDS
timeout "${G2_TIMEOUT:-150}" "$py" -m client.bench.attention --device cuda --dtype bfloat16 \
    --json "$out/g2.json" >"$out/g2.log" 2>&1
echo "G2: exit $? in $((SECONDS - start)) s"; tail -16 "$out/g2.log"

start=$SECONDS
# The KV pool holds every request of the workload at its longest (256 x 2048 tokens of 32 KiB).
timeout "${G3_TIMEOUT:-300}" "$py" -m client.bench G3 --model "$ckpt" --systems "${G3_SYSTEMS:-continuous,static,hf-continuous}" \
    --engine device=cuda --engine dtype=bfloat16 --engine kv_cache_memory_mb=20480 --no-progress \
    --note "random-weight Llama-3.2-1B shape (python -m tools.random_checkpoint --shape llama3-1b --dtype bfloat16)" \
    --json "$out/g3.json" >"$out/g3.log" 2>&1
echo "G3: exit $? in $((SECONDS - start)) s"; tail -30 "$out/g3.log"
