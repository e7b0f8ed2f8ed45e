#!/usr/bin/env bash
# tools/gpu_check.sh DIR -- the checks that need a GPU, in under five minutes.
#
# Runs, writing everything into DIR:
#   1. the cuda-marked tests          -> DIR/junit-cuda.xml, DIR/pytest-cuda.log
#   2. the NVRTC kernel report for sm_80, sm_90 and this device's arch
#                                     -> DIR/kernels.json, DIR/kernels.log
#   3. `python -m oasr bench --quick --device cuda` -> DIR/bench.json (rows), DIR/bench.log (tables)
# plus DIR/env.txt (nvidia-smi, torch and cuda-python versions).
# The device machine has torch and cuda-python but no network: pytest, hypothesis, numpy and tqdm
# come from wheels carried in ./wheels (`pip download -d wheels pytest hypothesis tqdm`), if missing.
# Exits non-zero if the tests or the kernel report fail (a missing bench is fine).
set -u -o pipefail

DIR=${1:?usage: tools/gpu_check.sh DIR}
mkdir -p "$DIR"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python}

if ! $PY -c "import pytest, hypothesis, tqdm, numpy" 2>/dev/null && [ -d wheels ]; then
    $PY -m pip install -q --no-index --find-links wheels pytest hypothesis tqdm numpy 2>&1 | tail -2
fi
$PY -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -1 || true

{
    nvidia-smi 2>&1 || echo "nvidia-smi: not available"
    $PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'available', torch.cuda.is_available())"
    $PY -c "import cuda.core, cuda.bindings; print('cuda.core', cuda.core.__version__, 'cuda.bindings', cuda.bindings.__version__)"
} >"$DIR/env.txt" 2>&1

echo "== cuda tests"
timeout 180 $PY -m pytest -m cuda tests -q -rs -p no:cacheprovider --junitxml="$DIR/junit-cuda.xml" 2>&1 | tee "$DIR/pytest-cuda.log"
tests_rc=${PIPESTATUS[0]}

echo "== kernel report"
ARCHS=sm_80,sm_90
DEV_ARCH=$($PY -c "import torch; m, n = torch.cuda.get_device_capability(); print(f'sm_{m}{n}')" 2>/dev/null || true)
case ",$ARCHS," in *",$DEV_ARCH,"*) ;; *) [ -n "$DEV_ARCH" ] && ARCHS="$ARCHS,$DEV_ARCH" ;; esac
timeout 60 $PY -m oasr kernels --arch "$ARCHS" --json "$DIR/kernels.json" 2>&1 | tee "$DIR/kernels.log"
kernels_rc=${PIPESTATUS[0]}

echo "== bench"
timeout 120 $PY -m oasr bench --quick --device cuda --sections bookkeeping,attention,fp8 \
    --json "$DIR/bench.json" >"$DIR/bench.log" 2>&1
echo "bench exit code $?" | tee -a "$DIR/bench.log"

echo "tests rc=$tests_rc kernels rc=$kernels_rc" | tee "$DIR/summary.txt"
[ "$tests_rc" -eq 0 ] && [ "$kernels_rc" -eq 0 ]
