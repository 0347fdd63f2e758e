#!/usr/bin/env bash
# One GPU session's checks, in one command (a lent H100/H200 is short-lived): the CUDA tier of the
# tests, then the GPU benchmarks. Run from the repository root on the CUDA machine, with a
# transformers wheel of the tested range in .whl/ when the machine's own is older:
#
#   OUT=/some/folder bash benchmarks/gpu_check.sh [seconds for the benchmarks, default 240] [steps]
#
# steps: "all" (default: the CUDA tier, the layer, decode and sweep benchmarks) or "triton" (the
# triton_blocks backend of issue 34: its kernel tests, default and slow tier, compiled on the GPU;
# then structured masks, the tile settings and the sweep with it beside cuDNN/flash/efficient SDPA
# and compiled flex). Each fits one device command of 10 minutes at the default budget.
# Logs and CSVs land in $OUT; docs/performance.md ("On the GPU") says what each run found.
set -u
OUT=${OUT:-benchmarks/results/gpu-check}
BUDGET=${1:-240}
STEPS=${2:-all}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
{
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
    python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'cudnn', torch.backends.cudnn.version(), 'triton', triton.__version__, 'transformers', transformers.__version__)"
    git log --oneline -1 2>/dev/null || true
} 2>&1 | tee "$OUT/machine.txt"

if [ "$STEPS" = "triton" ]; then
    # 1. The kernels compiled for the GPU against the fp64 oracle: every mask kind, fp32/bf16/fp16.
    timeout 240 python3 -m pytest tests/backends/test_triton_blocks.py -m "slow or not slow" -q -n 12 \
        -p no:cacheprovider -o addopts="" 2>&1 | tail -n 60 > "$OUT/triton_tests.log"
    echo "triton_blocks tests: exit ${PIPESTATUS[0]}"; tail -n 15 "$OUT/triton_tests.log"
    # 2. Structured masks and the tiles (fwd, fwd+bwd), then the dense sweep, with triton_blocks.
    timeout $((BUDGET + 60)) python3 benchmarks/gpu.py --only structured tiles sweep --passes fwd fwdbwd \
        --budget "$BUDGET" > "$OUT/gpu_triton.log" 2>&1
    echo "gpu.py: exit $?"; grep -A 40 -E "^## (structured|triton_blocks tiles|sweep D=128)" "$OUT/gpu_triton.log" | head -n 120
    cp benchmarks/results/gpu_structured.csv benchmarks/results/gpu_tiles.csv benchmarks/results/gpu_sweep.csv "$OUT/" \
        2>/dev/null
    exit 0
fi

# 1. The CUDA variants of the default tier (the slow tier's take longer than one lease allows).
timeout 220 python3 -m pytest -m "not slow" -k cuda -q -n 12 -p no:cacheprovider -o addopts="" 2>&1 \
    | tail -n 60 > "$OUT/cuda_tier.log"
echo "cuda tier: exit ${PIPESTATUS[0]}"; tail -n 15 "$OUT/cuda_tier.log"

# 2. Where the layer's bf16 forward spends its time (host against GPU), then the benchmarks.
timeout 90 python3 benchmarks/gpu_layer_host.py 2>&1 | tee "$OUT/layer_host.log" | head -n 12
timeout $((BUDGET + 60)) python3 benchmarks/gpu.py --only layer decode sweep --passes fwd fwdbwd --budget "$BUDGET" \
    > "$OUT/gpu_bench.log" 2>&1
echo "gpu.py: exit $?"; grep -E "^ *(fwd|fwdbwd):|multihead/fused|ratio" "$OUT/gpu_bench.log" | head -n 20
cp benchmarks/results/gpu_layer.csv benchmarks/results/gpu_decode.csv benchmarks/results/gpu_sweep.csv "$OUT/" 2>/dev/null
true
