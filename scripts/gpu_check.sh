#!/usr/bin/env bash
# Issue 31's GPU check, in one go, on a machine with a CUDA GPU (a few minutes):
#   bash scripts/gpu_check.sh [OUT_DIR]        (PYTHON=... to pick the interpreter)
# 1. the environment: GPU name and memory, torch and its CUDA, the commit;
# 2. split == unsplit with stages on the GPU (tests/test_device_gpu.py: one GPU, CPU/GPU
#    mixes, the relay through Flower's message path, direct over gloo; tolerances in
#    that file's docstring) and the CPU-side device checks (tests/test_device.py);
# 3. the per-device layer table and a mixed fleet's plans (python -m sky_flower.bench.devices);
# 4. the benchmark round and a 2-round Sky run with the GPU node in the fleet
#    (fleet=gpu3: cloud-gpu on CUDA, phone and edge-box on the CPU; Flower's simulation
#    engine), relay then direct; each node's device from benchmark.json.
# Every step is bounded (timeout) and the script goes on after a failed step; the
# summary at the end lists each step's exit status. Everything lands in OUT_DIR.
set -u
cd "$(dirname "$0")/.."
OUT=${1:-${OUT:-gpu_check_out}}
mkdir -p "$OUT"
if [ -z "${PYTHON:-}" ]; then
  if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
declare -a STATUS=()

step() {  # step NAME TIMEOUT_S CMD...: run, tee to OUT/NAME.txt, record the status
  local name=$1 limit=$2
  shift 2
  echo "=== $name ($(date -u +%H:%M:%S) UTC) ==="
  timeout "$limit" "$@" 2>&1 | tee "$OUT/$name.txt"
  local rc=${PIPESTATUS[0]}
  STATUS+=("$name: exit $rc")
  echo "=== $name: exit $rc ==="
}

step env 60 bash -c "date -u; git rev-parse --short HEAD 2>/dev/null || true; \
  nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv 2>/dev/null || true; \
  $PYTHON - <<'PY'
import importlib, torch
print('torch', torch.__version__, 'CUDA build', torch.version.cuda,
      'available', torch.cuda.is_available(), 'GPUs', torch.cuda.device_count())
for i in range(torch.cuda.device_count()):
    p = torch.cuda.get_device_properties(i)
    print(f'cuda:{i}', p.name, f'{p.total_memory / 2**30:.1f} GiB')
for mod in ('flwr', 'ray', 'hydra', 'scipy', 'sklearn', 'hypothesis'):
    try:
        m = importlib.import_module(mod)
        print(mod, getattr(m, '__version__', 'present'))
    except ImportError as err:
        print(mod, 'MISSING:', err)
PY"

step tests 300 "$PYTHON" -m pytest -q -p no:cacheprovider -rs \
  tests/test_device_gpu.py tests/test_device.py

step bench_devices 180 "$PYTHON" -m sky_flower.bench.devices

SKY_ARGS=(fleet=gpu3 num_rounds=2 train.steps_per_round=5 train.lr=0.001
  benchmark.repeats=5 benchmark.echo_repeats=3 benchmark.state_probe_mb=4)
step sky_relay 420 "$PYTHON" -m sky_flower.run "${SKY_ARGS[@]}" transport=relay \
  "hydra.run.dir=$OUT/sky_relay"
step sky_direct 420 "$PYTHON" -m sky_flower.run "${SKY_ARGS[@]}" transport=direct \
  "hydra.run.dir=$OUT/sky_direct"

step devices_in_benchmark_json 60 "$PYTHON" - "$OUT" <<'PY'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
for run in ("sky_relay", "sky_direct"):
    path = out / run / "benchmark.json"
    if not path.exists():
        print(f"{run}: no benchmark.json")
        continue
    for n in json.loads(path.read_text())["nodes"]:
        fb = (sum(n["layer_fwd_s"]) + sum(n["layer_bwd_s"])) * 1e3
        print(f"{run}: {n['name']:<10} {n['device']:<7} {n['device_name']:<40} "
              f"fwd+bwd {fb:8.3f} ms  memory {n['memory_bytes'] / 2**20:9.0f} MiB")
    res = out / run / "results.json"
    if res.exists():
        r = json.loads(res.read_text())
        print(f"{run}: completed={r.get('completed')} error={r.get('error')}")
PY

echo "=== summary ==="
printf '%s\n' "${STATUS[@]}" | tee "$OUT/summary.txt"
