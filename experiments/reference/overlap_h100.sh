#!/bin/bash
# The device check of docs/overlap.md: experiments.overlap_gpu on one real
# GPU under JAX's mock client (4 one-GPU hosts, one worker each, the
# collectives mocked), each program timed and the window programs profiled
# (GPU command buffers off, so that every kernel names its HLO
# instruction). Run from the repository root on a machine with one GPU and
# jax[cuda]; the flax / optax / ml_collections wheels a machine lacks go in
# .whl/. Writes at most 8 files to $OUT (default /tmp/overlap_h100):
# overlap_gpu_h100.json (the results), the log, the programs' HLO and the
# Perfetto trace. Arguments go to experiments.overlap_gpu (sizes, say).
OUT=${OUT:-/tmp/overlap_h100}
W=/tmp/overlap_h100_work
rm -rf "$W" && mkdir -p "$W" "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
    --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
export PYTHONUNBUFFERED=1
python3 -c 'import jax, flax, optax, ml_collections; print(jax.__version__, flax.__version__, optax.__version__, jax.devices())' || exit 1
nvidia-smi --query-gpu=name,driver_version,memory.used --format=csv,noheader
run() {  # name timeout flags...: SIGABRT on timeout dumps Python's stacks
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  timeout -s ABRT "$limit" python3 -X faulthandler -m experiments.overlap_gpu \
    --workdir="$W/$name" --hlo_dir="$W/$name/hlo" \
    --profile_dir="$W/$name/prof" --results_name=overlap_gpu_h100 \
    --mock_processes=4 --timed=10 "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  echo "== $name: rc=$rc in $((SECONDS - t0)) s"
  grep -v '^[IW][0-9]' "$OUT/$name.log" | tail -40
  cp "$W/$name/overlap_gpu_h100.json" "$OUT/" 2>/dev/null
  [ -d "$W/$name/hlo" ] && tar -czf "$OUT/${name}_hlo.tar.gz" -C "$W/$name" hlo
  local trace
  trace=$(find "$W/$name" -name perfetto_trace.json.gz | head -1)
  [ -n "$trace" ] && cp "$trace" "$OUT/${name}_trace.json.gz"
  return $rc
}
# Autotuning once hung a run here; the retry skips it.
run mock4 "${MOCK_LIMIT:-240}" "$@" ||
  XLA_FLAGS="$XLA_FLAGS --xla_gpu_autotune_level=0" run mock4_noautotune \
    "${RETRY_LIMIT:-150}" "$@"
ls -la "$OUT"
