# Sourced by the device-call scripts (scripts/gpu_*.sh): $OUT, the carried fla wheels (.whl, if
# any) on PYTHONPATH, unbuffered output so a time-boxed step keeps what it printed.
OUT=${OUT:-/tmp/k3-gpu}; mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:.
else
  export PYTHONPATH=.
fi
export PYTHONUNBUFFERED=1
# `k3 bench-kernel` against fla, JSON rows (the session scripts add --shape ...)
BENCH="python3 -m k3cli.cli bench-kernel --kernel chunk_kda --against fla --json"
