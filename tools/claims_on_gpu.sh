#!/usr/bin/env bash
# The claims study's data-parallel, DiLoCo M = 1 and DiLoCo M = 4 rows at 2M
# and 8M parameters on one GPU (M = 4 with its workers stacked on the GPU,
# mesh.simulate_workers) (experiments/claims.py, "Part of the study can run
# elsewhere"). Run from the repository root on a machine with jax[cuda] and
# the packages of pyproject.toml; the data is the corpus file
# .claims_src/stdlib.tar (the standard library of this checkout's Python, the
# text this study reads on the CPU machine, so the rows compare and record
# the same corpus fingerprint), made by `tools/claims_on_gpu.sh --prepare`
# (loc_opt.data.export_corpus). The rows of earlier sessions read a copy of
# a standard library in .claims_src/stdlib whose Python was not recorded.
#
#   tools/claims_on_gpu.sh OUT_DIR [SECONDS]
#
# (SIZES="2M 8M" and STEPS=600 by default; smaller values make a smoke test.)
# Runs already in PRIOR's files (default docs/results/claims_gpu/, the rows
# of earlier sessions) or in MERGED (docs/results/claims.json, every
# finished row, the CPU's included) are not trained again: their rows are
# imported, so a later session goes on where the last stopped and phase 2
# picks each method's best setting from every row. GEMM autotuning is off
# (XLA_FLAGS=--xla_gpu_autotune_level=0): with 8 processes on one GPU it
# took a whole 5-minute call before the first step; the math is the same
# float32, by other kernels.
#
# Phase 1 sweeps the tuned values (data-parallel inner lr; DiLoCo outer lr
# at each inner lr), one process per setting, PARALLEL (8) at a time on the
# one GPU; phase 2 runs the
# extra seeds of each best setting. OUT_DIR gets one claims.json per size and
# method (import them here with --import_results) and the logs. Float32
# matmuls run at full precision (the GPU default is TF32), as on the CPU.
set -u
if [[ "${1:-}" == --prepare ]]; then
  rm -rf .claims_src && mkdir -p .claims_src
  exec .venv/bin/python -m loc_opt.data.export_corpus .claims_src/stdlib.tar
fi
out=${1:?usage: tools/claims_on_gpu.sh OUT_DIR [SECONDS]}
budget=${2:-540}
mkdir -p "$out"
export XLA_PYTHON_CLIENT_PREALLOCATE=false JAX_DEFAULT_MATMUL_PRECISION=highest
export PYTHONUNBUFFERED=1
export XLA_FLAGS="--xla_gpu_autotune_level=0 ${XLA_FLAGS:-}"
prior=${PRIOR:-docs/results/claims_gpu}
work=${WORK:-/tmp/claims_gpu}
sizes=${SIZES:-2M 8M}
mkdir -p "$work"
common=(--num_steps=${STEPS:-600} --cpu_devices=1 --config.mesh.workers=1
        --config.mesh.data=1 --config.mesh.fsdp=1 --config.mesh.tensor=1
        --config.data.corpus_file=.claims_src/stdlib.tar)
start=$SECONDS
# "size method flags knob inner": the grid of experiments/claims.py.
phase1=()
for size in $sizes; do
  for lr in 2.4e-2 1.2e-2 6e-3 3e-3 1.5e-3; do
    phase1+=("$size dp --dp_lrs=$lr $lr -")
  done
  for inner in 3e-3 6e-3 1.2e-2; do
    for lr in 0.2 0.4 0.7 1.0; do
      phase1+=("$size diloco_m1 --outer_lrs=$lr,--diloco_inner_lrs=$inner $lr $inner")
    done
  done
done
# M = 4 with its workers stacked on the one GPU (--simulate_workers), after
# the rest: the outer lr at the inner lrs that won for M = 1 and at 0.5M.
for size in $sizes; do
  for inner in 3e-3 6e-3; do
    for lr in 0.4 0.7 1.0 0.2; do
      phase1+=("$size diloco_m4 --outer_lrs=$lr,--diloco_inner_lrs=$inner,--simulate_workers $lr $inner")
    done
  done
done
# Every finished row (this machine's and the CPU's): docs/results/claims.json.
merged=${MERGED:-docs/results/claims.json}
done_before() {  # size method knob inner: its seed-0 run is in PRIOR/MERGED?
  python3 -c "import json, sys; from experiments import _claims
rows = []
for path in ('$prior/$1_$2.json', '$merged'):
  try:
    rows += json.load(open(path))['results']['rows']
  except OSError:
    pass
inner = None if '$4' in ('-', '3e-3') else float('$4')
sys.exit(_claims.run_name('$1', '$2', float('$3'), 0, inner) not in
         {r['name'] for r in rows})"
}
for job in "${phase1[@]}"; do
  read -r size method flags tag inner <<<"$job"
  if done_before "$size" "$method" "$tag" "$inner"; then continue; fi
  while (($(jobs -rp | wc -l) >= ${PARALLEL:-8})); do wait -n; done
  IFS=, read -r -a extra <<<"$flags"
  timeout $((budget * 6 / 10 - (SECONDS - start))) python3 -m \
    experiments.claims --workdir="$work/${size}_${method}_${tag}_$inner" \
    --sizes="$size" --methods="$method" "${extra[@]}" --seeds= \
    "${common[@]}" >"$work/${size}_${method}_${tag}_$inner.log" 2>&1 &
done
wait
echo "phase 1 done after $((SECONDS - start)) s"
for size in $sizes; do
  for method in dp diloco_m1 diloco_m4; do
    files=$(ls "$prior/${size}_${method}.json" "$merged" \
      "$work"/${size}_${method}_*/claims.json 2>/dev/null | paste -sd,)
    [[ -n "$files" ]] || continue
    # (M = 4's grid is phase 1's inner lrs: no new cells before its seeds.)
    inners=()
    [[ $method == diloco_m4 ]] && inners=(--diloco_inner_lrs=3e-3,6e-3)
    timeout $((budget - (SECONDS - start))) python3 -m experiments.claims \
      --workdir="$work/${size}_${method}" --sizes="$size" --methods="$method" \
      --import_results="$files" --simulate_workers "${inners[@]}" \
      "${common[@]}" \
      >"$work/${size}_${method}.log" 2>&1 &
  done
done
wait
echo "phase 2 done after $((SECONDS - start)) s"
for size in $sizes; do
  for method in dp diloco_m1 diloco_m4; do
    cp "$work/${size}_${method}/claims.json" "$out/${size}_${method}.json" \
      2>/dev/null || echo "no results for $size $method"
  done
done
tail -n 4 "$work"/*.log >"$out/logs.txt"
