#!/usr/bin/env bash
# The AMX checks of one session on an Intel Xeon with AMX (amx_tile, amx_bf16), such as the
# host CPU of this workplace's GPU machines: the C++ kernels built for that CPU, the tests
# that need AMX hardware on the default path, which is AMX there (the panel GEMM's and the
# linear layers' in tests/kernels/test_linear.py, the engine's bfloat16 batch-invariance
# tests), then W1 bfloat16 in process on 2 cores (the project's machine size) on the
# AVX512-BF16 path (INFLIGHT_CPU_ISA=avx512_bf16) and on the AMX path, alternating, two runs each.
#
#   bash client/bench/scripts/amx_checks.sh OUT_DIR [PYTHON]
#
# Writes OUT_DIR/amx_tests.log, amx_tests.xml, w1_<isa>_<run>.json and .log. Each step has
# its own time limit (TESTS_TIMEOUT, W1_TIMEOUT seconds). The checkpoint is random weights
# in the default checkpoint's shape (python -m tools.random_checkpoint --shape smollm2-135m),
# which needs only the default tokenizer's files (`make setup`, or a copy of them).
set -u
out=${1:?usage: bash client/bench/scripts/amx_checks.sh OUT_DIR [PYTHON]}
py=${2:-python3}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
grep -m1 "model name" /proc/cpuinfo
built=$("$py" -c "from kernels import cpu_ext; print(cpu_ext.built_isa().name)" 2>"$out/build.log")
echo "C++ kernels built for: $built"
if [ "$built" != AMX ]; then
    echo "no AMX path in this build (see $out/build.log): not an AMX CPU, or no compiler"; exit 1
fi

start=$SECONDS
env -u INFLIGHT_CPU_ISA timeout "${TESTS_TIMEOUT:-200}" "$py" -m pytest -q -p no:cacheprovider -rs \
    --junitxml="$out/amx_tests.xml" tests/kernels/test_linear.py tests/engine/test_batch_invariance.py \
    -k "not avx2_only_machine and not tile_path_under" >"$out/amx_tests.log" 2>&1
echo "tests: exit $? in $((SECONDS - start)) s"; tail -8 "$out/amx_tests.log"

ckpt=${AMX_CHECKPOINT:-/tmp/random-smollm2-135m}
"$py" -m tools.random_checkpoint "$ckpt" --shape smollm2-135m >/dev/null 2>&1 || echo "checkpoint failed"
for run in 1 2; do
    for isa in avx512_bf16 amx; do
        start=$SECONDS
        INFLIGHT_CPU_ISA=$isa timeout "${W1_TIMEOUT:-120}" taskset -c 0,1 "$py" -m client.bench W1 --model "$ckpt" \
            --systems continuous --engine dtype=bfloat16 --no-progress \
            --note "INFLIGHT_CPU_ISA=$isa on 2 cores (taskset -c 0,1); random weights in SmolLM2-135M's shape" \
            --json "$out/w1_${isa}_$run.json" >"$out/w1_${isa}_$run.log" 2>&1
        echo "W1 $isa run $run: exit $? in $((SECONDS - start)) s: $(grep -m1 '^continuous:' "$out/w1_${isa}_$run.log")"
    done
done
