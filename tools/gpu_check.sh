#!/usr/bin/env bash
# tools/gpu_check.sh DIR -- the checks that need a GPU, as one prepared run of under 8 minutes on a bare machine.
#
# Runs from the repository root (nothing is installed from it: `python -m` imports ./oasr), writing
# everything into DIR (on a lent device machine: DIR=$OUT, so it comes back):
#   0. DIR/env.txt: nvidia-smi, python, torch, triton, cuda-python, flashinfer versions; DIR/install.log
#   1. the cuda-marked tests (v1, v2, v3 against the reference, graph replay == eager, ...)
#                                                -> DIR/junit-cuda.xml, DIR/pytest-cuda.log      (<= 240 s)
#   2. `python -m oasr bench --quick --device cuda --sections attention`: v1, v2, v3, SDPA on gathered
#      K/V, FlexAttention over the pages and FlashInfer (when it imports) at 128 streams x {256, 1024,
#      4096} frames, bf16 and fp8 pages, each timed kernel-only (graph replay), per call with the
#      launcher (events) and on the host clock (oasr/bench/attention_gpu.py)
#                                                -> DIR/bench.json (rows), DIR/bench.log (tables) (<= 200 s)
#   3. tools/gpu_report.py: those rows as markdown, appended to docs/kernels.md under a dated heading
#      naming the device, and kept in DIR/kernels-md-append.md (the docs edit of a remote run is lost
#      with the machine; that file is not)
#   DIR/summary.txt: the exit codes.
# GPU_CHECK_EXTRA=1 adds the graphs bench and the NVRTC kernel report (sm_80, sm_90, this device),
# which the time budget leaves out by default (CPU CI covers the report).
# The device machine may have no network. Wheels carried in ./wheels are installed when present
# (all optional): e.g. `pip download -d wheels pytest hypothesis tqdm numpy cuda-python
# nvidia-cuda-nvrtc nvidia-cuda-runtime flashinfer-python flashinfer-cubin`. Python is $PYTHON, else python3.
# Exits 1 if the tests fail (a failed bench is reported, not fatal), 2 when torch sees no CUDA
# device (then nothing ran on a GPU, whatever the tests said).
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
    $PY -c "import triton; print('triton', triton.__version__)" 2>&1 | tail -1
    $PY -c "import pytest, hypothesis, tqdm, numpy; print('pytest', pytest.__version__)" 2>&1 | tail -1
} >"$DIR/env.txt" 2>&1
cat "$DIR/env.txt"

echo "== cuda tests"
timeout 240 $PY -m pytest -m cuda tests -q -rs -p no:cacheprovider --junitxml="$DIR/junit-cuda.xml" 2>&1 \
    | tee "$DIR/pytest-cuda.log" | tail -15
tests_rc=${PIPESTATUS[0]}

echo "== attention bench (graph replay, events, host clock)"
timeout 200 $PY -m oasr bench --quick --device cuda --sections attention --json "$DIR/bench.json" \
    >"$DIR/bench.log" 2>&1
bench_rc=$?
echo "bench exit code $bench_rc" | tee -a "$DIR/bench.log"

echo "== report"
DEVICE_NAME=$($PY -c "import torch; print(torch.cuda.get_device_name())" 2>/dev/null || echo "a CUDA device")
$PY tools/gpu_report.py "$DIR/bench.json" --device "$DEVICE_NAME" >"$DIR/kernels-md-append.md" 2>&1
report_rc=$?
if [ "$report_rc" -eq 0 ]; then
    $PY tools/gpu_report.py "$DIR/bench.json" --device "$DEVICE_NAME" --append docs/kernels.md >/dev/null
    cp docs/kernels.md "$DIR/kernels.md"
fi
cat "$DIR/kernels-md-append.md"

if [ "${GPU_CHECK_EXTRA:-0}" = 1 ]; then
    echo "== graphs bench"
    timeout 120 $PY -m oasr bench --quick --device cuda --sections graphs --json "$DIR/bench-graphs.json" \
        >"$DIR/bench-graphs.log" 2>&1
    echo "graphs bench exit code $?" | tee -a "$DIR/bench-graphs.log"
    echo "== kernel report"
    ARCHS=sm_80,sm_90
    DEV_ARCH=$($PY -c "import torch; m, n = torch.cuda.get_device_capability(); print(f'sm_{m}{n}')" 2>/dev/null || true)
    case ",$ARCHS," in *",$DEV_ARCH,"*) ;; *) [ -n "$DEV_ARCH" ] && ARCHS="$ARCHS,$DEV_ARCH" ;; esac
    timeout 120 $PY -m oasr kernels --arch "$ARCHS" --json "$DIR/kernels.json" 2>&1 | tee "$DIR/kernels.log" | tail -5
fi

echo "tests rc=$tests_rc bench rc=$bench_rc report rc=$report_rc" | tee "$DIR/summary.txt"
if ! $PY -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    echo "no CUDA device: the cuda tests were skipped and nothing ran on a GPU" | tee -a "$DIR/summary.txt"
    exit 2
fi
[ "$tests_rc" -eq 0 ]
