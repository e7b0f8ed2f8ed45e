#!/usr/bin/env bash
# tools/gpu_check.sh DIR -- the checks that need a GPU, in under five minutes, on a bare machine.
#
# Runs from the repository root (nothing is installed from it: `python -m` imports ./oasr), writing
# everything into DIR:
#   0. DIR/env.txt: nvidia-smi, python, torch, cuda-python, flashinfer versions; DIR/install.log
#   1. the cuda-marked tests                     -> DIR/junit-cuda.xml, DIR/pytest-cuda.log
#   2. `python -m oasr bench --quick --device cuda` (its attention section compares v1, v2, SDPA on
#      gathered K/V and FlashInfer at the ASR shape: oasr/bench/attention_gpu.py)
#                                                -> DIR/bench.json (rows), DIR/bench.log (tables)
#   3. the graphs bench (engine tick, CUDA-graphed vs eager) -> DIR/bench-graphs.json, DIR/bench-graphs.log
#      (the graphed-engine tests, tests/test_graphs_cuda.py, run with the cuda tests in step 1)
#   4. the NVRTC kernel report for sm_80, sm_90 and this device's arch (+ --sass when the pip
#      nvdisasm is present)                      -> DIR/kernels.json, DIR/kernels.log
#   DIR/summary.txt: the exit codes.
# The device machine may have no network. Wheels carried in ./wheels are installed when present
# (all optional): e.g. `pip download -d wheels pytest hypothesis tqdm numpy cuda-python
# nvidia-cuda-nvrtc nvidia-cuda-runtime nvidia-cuda-nvdisasm nvidia-cuda-cuobjdump flashinfer-python
# flashinfer-cubin`. Python is $PYTHON, else python3.
# Exits 1 if the tests or the kernel report fail (a failed bench is reported, not fatal), 2 when
# torch sees no CUDA device (then nothing ran on a GPU, whatever the tests said).
set -u -o pipefail

DIR=${1:?usage: tools/gpu_check.sh DIR}
mkdir -p "$DIR"
DIR=$(cd "$DIR" && pwd)
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 MPLBACKEND=Agg
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY=${PYTHON:-python3}

{
    echo "== carried wheels"
    if [ -d wheels ] && ls wheels/*.whl >/dev/null 2>&1; then
        for whl in wheels/*.whl; do  # one at a time: a wheel that cannot install does not stop the others
            $PY -m pip install -q --no-index --find-links wheels "$whl" || echo "could not install $whl"
        done
    else
        echo "no ./wheels: using what is installed"
    fi
} >"$DIR/install.log" 2>&1

{
    nvidia-smi 2>&1 || echo "nvidia-smi: not available"
    $PY --version
    $PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'available', torch.cuda.is_available())"
    $PY -c "import cuda.core, cuda.bindings; print('cuda.core', cuda.core.__version__, 'cuda.bindings', cuda.bindings.__version__)"
    $PY -c "import flashinfer; print('flashinfer', flashinfer.__version__)" 2>&1 | tail -1
    $PY -c "import pytest, hypothesis, tqdm, numpy; print('pytest', pytest.__version__)" 2>&1 | tail -1
} >"$DIR/env.txt" 2>&1
cat "$DIR/env.txt"

echo "== cuda tests"
timeout 240 $PY -m pytest -m cuda tests -q -rs -p no:cacheprovider --junitxml="$DIR/junit-cuda.xml" 2>&1 \
    | tee "$DIR/pytest-cuda.log"
tests_rc=${PIPESTATUS[0]}

echo "== bench"
timeout 120 $PY -m oasr bench --quick --device cuda --sections attention,fp8,bookkeeping \
    --json "$DIR/bench.json" >"$DIR/bench.log" 2>&1
bench_rc=$?
echo "bench exit code $bench_rc" | tee -a "$DIR/bench.log"
grep -A 40 "== attention" "$DIR/bench.log" | head -60

echo "== graphs bench"
timeout 120 $PY -m oasr bench --quick --device cuda --sections graphs --json "$DIR/bench-graphs.json" \
    >"$DIR/bench-graphs.log" 2>&1
echo "graphs bench exit code $?" | tee -a "$DIR/bench-graphs.log"

echo "== kernel report"
ARCHS=sm_80,sm_90
DEV_ARCH=$($PY -c "import torch; m, n = torch.cuda.get_device_capability(); print(f'sm_{m}{n}')" 2>/dev/null || true)
case ",$ARCHS," in *",$DEV_ARCH,"*) ;; *) [ -n "$DEV_ARCH" ] && ARCHS="$ARCHS,$DEV_ARCH" ;; esac
SASS=""
$PY -c "from oasr.fast.kernels.sass import find_tool; find_tool('nvdisasm'); find_tool('cuobjdump')" 2>/dev/null \
    && SASS="--sass"
timeout 120 $PY -m oasr kernels --arch "$ARCHS" $SASS --json "$DIR/kernels.json" 2>&1 | tee "$DIR/kernels.log"
kernels_rc=${PIPESTATUS[0]}

echo "tests rc=$tests_rc kernels rc=$kernels_rc bench rc=$bench_rc" | tee "$DIR/summary.txt"
if ! $PY -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    echo "no CUDA device: the cuda tests were skipped and nothing ran on a GPU" | tee -a "$DIR/summary.txt"
    exit 2
fi
[ "$tests_rc" -eq 0 ] && [ "$kernels_rc" -eq 0 ]
