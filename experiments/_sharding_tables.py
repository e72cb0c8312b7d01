"""Renderers of the compile-only tables of docs/sharding.md and
docs/overlap.md.

``experiments.scale_check`` (the ~1B and ~8B configs of
``configs/scale_lm.py``: memory and bytes of the compiled inner and sync
steps), ``experiments.outer_state_memory`` (DiLoCo's outer state per
layout), ``experiments.sharded_sync_bytes`` (the sync's bytes,
replicated against sharded outer state) and ``experiments.overlap_gpu``
(what the GPU schedule runs while each sync is in flight) write the
results files;
``experiments.tables`` renders them with these.
"""

from typing import Any

from experiments import _registry


def _mib(n: float) -> str:
  return f'{n / 2**20:,.0f}'


def _ratio(a: float, b: float) -> str:
  return f'{a / b:.2f}x' if b else '-'


def scale_check_main(data: dict[str, Any]) -> str:
  """One row per compiled step: memory per device, within-worker bytes
  against ideal FSDP + Megatron, cross-worker bytes against the fp32
  parameters, compile time."""
  rows = data['results']['rows']
  params = sorted({r['params'] for r in rows})
  lines = [
      f'{", ".join(f"{p / 1e6:,.1f}M" for p in params)} parameters; '
      'compile only; compile seconds on a 2-core machine shared with other '
      'jobs (rough).', '',
      '| code | mesh (w x d x f x t) | step | arg MiB/dev | temp MiB/dev '
      '| within-worker MiB | vs ideal | cross-worker MiB/worker '
      '| vs fp32 params | compile s |',
      '|---|---|---|---|---|---|---|---|---|---|']
  for r in rows:
    within, cross = (r['within_worker_bytes'],
                     r['cross_worker_bytes_per_worker'])
    lines.append(
        f"| {r.get('code', '-')} | {r['mesh']} | {r['step']} "
        f"| {_mib(r['argument_bytes'])} | {_mib(r['temp_bytes'])} "
        f"| {_mib(within)} | {_ratio(within, r['ideal_within_worker_bytes'])} "
        f"| {_mib(cross)} | {_ratio(cross, r['param_bytes'])} "
        f"| {r['compile_seconds']:.1f} |")
  return '\n'.join(lines) + '\n'


def scale_sync_main(data: dict[str, Any]) -> str:
  """The sync step beside the inner step of the same config and mesh:
  temporary memory per device against the inner step's (target at most
  1.25x), within-worker bytes against ideal (target at most 1.2x),
  cross-worker bytes against the fp32 parameters. Ideal counts the
  activation all-reduces at the width the backend reduces in (float32 on
  XLA:CPU); a second ratio counts them at the activations' own width
  (bfloat16, as GPUs and TPUs reduce them)."""
  rows = data['results']['rows']
  inner = {(r['code'], r['mesh']): r for r in rows if r['step'] == 'inner'}
  lines = [
      'Compile only, 8 virtual CPU devices; scanned blocks, remat `full` '
      '(`full_tp` where the size says so); targets: sync temp at most 1.25x '
      'the inner step\'s, within-worker bytes at most 1.2x ideal. Ideal '
      'counts the Megatron all-reduces in float32, as XLA:CPU runs them; '
      '"bf16" counts them in bfloat16, as GPUs and TPUs do.', '',
      '| size | params | mesh (w x d x f x t) | step | arg MiB/dev '
      '| temp MiB/dev | temp vs inner | within-worker MiB | vs ideal '
      '| vs ideal, bf16 | cross-worker MiB/worker | vs fp32 params |',
      '|---|---|---|---|---|---|---|---|---|---|---|---|']
  for r in rows:
    within, cross = (r['within_worker_bytes'],
                     r['cross_worker_bytes_per_worker'])
    base = inner.get((r['code'], r['mesh']))
    vs_inner = _ratio(r['temp_bytes'], base['temp_bytes']) if base else '-'
    act = r.get('ideal_act_width_within_worker_bytes')
    lines.append(
        f"| {r['code']} | {r['params'] / 1e6:,.1f}M | {r['mesh']} "
        f"| {r['step']} | {_mib(r['argument_bytes'])} "
        f"| {_mib(r['temp_bytes'])} | {vs_inner} "
        f"| {_mib(within)} | {_ratio(within, r['ideal_within_worker_bytes'])} "
        f"| {_ratio(within, act) if act else '-'} "
        f"| {_mib(cross)} | {_ratio(cross, r['param_bytes'])} |")
  return '\n'.join(lines) + '\n'


def _kinds(kinds: dict[str, int] | None) -> str:
  if not kinds:
    return '-'
  return ' + '.join(f'{k} {v:,}' for k, v in kinds.items())


def outer_state_memory_main(data: dict[str, Any]) -> str:
  """One row per config and layout: the outer state's bytes per device (from
  shapes), the compiled sync step's argument bytes and its cross-worker
  collectives."""
  res = data['results']
  lines = ['| config | mesh (w x d x f x t) | layout | outer state MiB/dev '
           '| compiled args MiB/dev | sync collectives, bytes/dev |',
           '|---|---|---|---|---|---|']
  for r in res['rows']:
    mib = lambda b: f'{b / 2**20:,.1f}'
    here = mib(r['bytes_per_device'])
    if r['host_bytes_per_device']:
      here += f' ({mib(r["host_bytes_per_device"])} on the host)'
    args = r['compiled_argument_bytes']
    lines.append(
        f"| {r['config']}, {r['num_params'] / 1e6:,.1f}M params | {r['mesh']} "
        f"| {r['layout']} | {here} | {'-' if args is None else mib(args)} "
        f"| {_kinds(r['cross_worker_kinds'])} |")
  return '\n'.join(lines) + '\n'


def sharded_sync_bytes_main(data: dict[str, Any]) -> str:
  """One row per program and mesh: the sync step's cross-worker bytes with
  the outer state replicated and sharded per block (the trainer's rows as
  totals over all devices, the transform alone's per device by kind)."""
  lines = ['| program | mesh (w x d x f x t) | replicated sync '
           '| sharded sync, per block |', '|---|---|---|---|']
  named = set()
  for r in data['results']['rows']:
    what = ('trainer' if r['program'] == 'trainer' else 'transform alone')
    model = r['model']
    if r['program'] == 'trainer' and r['program'] in named:
      model = 'tiny LM'  # named in full on its first row
    named.add(r['program'])
    cells = []
    for layout in ('replicated', 'sharded'):
      s = r[layout]
      if r['program'] == 'trainer':
        cells.append(f"{s['cross_worker_bytes']:,}")
      else:  # largest first
        kinds = sorted(s['kinds'].items(), key=lambda kv: -kv[1])
        cells.append(' + '.join(f'{k} {v:,}' for k, v in kinds))
    lines.append(f"| {what}, {model}, {r['unit']} | {r['mesh']} "
                 f"| {cells[0]} | {cells[1]} |")
  return '\n'.join(lines) + '\n'


def overlap_gpu_main(data: dict[str, Any]) -> str:
  """Per cross-worker collective of each program compiled for GPUs: its
  size, whether it runs asynchronously, and the matrix products (and their
  window steps) scheduled while it is in flight (``experiments.overlap_gpu``)."""
  r = data['results']
  sizes = r['sizes']
  how = (f"compiled without a GPU for `{r['target_config']}`"
         if r.get('target_config') else
         f"mock GPU client ({r.get('mock_processes') or r['mock_topology']})")
  lines = [
      f"{len(r['devices'])} x {r['device_kind']}, one worker each ({how}); "
      f"the LM at {r['num_params']:,} parameters ({sizes['num_layers']} "
      f"layers, d_model {sizes['d_model']}, {sizes['batch']} x "
      f"{sizes['seq_len']} tokens per worker, {sizes['dtype']}), AdamW "
      'inside. A program\'s steps are numbered from its first (the sync); '
      'a one-step program has no window steps. A collective in a branch '
      'runs only when the plain mean is not finite (the guarded mean\'s '
      'second round).', '',
      '| program | phases | collective | runs | MB per device | async | '
      'matmuls in flight | their window steps |',
      '|---|---|---|---|---:|---|---:|---|']
  for row in r['schedule']:
    steps = (', '.join(map(str, row['steps_in_flight'])) or 'none'
             if row['kind'] == 'window' else '-')
    lines.append(
        f"| {row['program']} | `{row['phases']}` | {row['name']} | "
        f"{'in a branch' if row.get('in_branch') else 'always'} | "
        f"{row['bytes_per_device'] / 1e6:.1f} | "
        f"{'yes' if row['async'] else 'no'} | {row['matmuls_in_flight']} | "
        f'{steps} |')
  buffers = ('' if r.get('command_buffers', True) else
             ', GPU command buffers off')
  if r.get('timing'):
    mocked = r.get('mock_processes') or r.get('mock_topology')
    what = ('mocked collectives' if mocked else 'real collectives'
            if len(r['devices']) > 1 else 'one worker, no collective')
    lines += ['', f'| program | steps | median s per step ({what}'
              f'{buffers}) |', '|---|---|---|']
    for name, t in r['timing'].items():
      lines.append(f"| {name} | {t['steps']} | {t['per_step_s']:.5f} |")
  if r.get('profile'):
    lines += _profile_lines(r['profile'], len(r['devices']), buffers)
  if r.get('error'):
    lines += ['', f"Failed: {r['error']}"]
  return '\n'.join(lines) + '\n'


def _profile_lines(rows, workers: int, buffers: str) -> list[str]:
  """The profile's table: device time in flight per collective."""
  lines = ['', f'Profiled (the last of two calls{buffers}): the device time '
           "of the kernels scheduled while each collective is in flight, "
           "and the link per worker at which a ring all-reduce of its bytes "
           f'among {workers} workers takes exactly that long (it is hidden '
           'in full on any faster link).', '',
           '| program | collective | MB per device | kernels in flight | '
           'ms in flight | the call\'s kernels, ms | hidden from Gbit/s |',
           '|---|---|---:|---:|---:|---:|---:|']
  for row in rows:
    gbps = row['gbps_hidden']
    loose = (f" ({row['unattributed_kernels']} not attributed)"
             if row['unattributed_kernels'] else '')
    lines.append(
        f"| {row['program']} | {row['name']}"
        f"{' (in a branch)' if row['in_branch'] else ''} | "
        f"{row['bytes_per_device'] / 1e6:.1f} | {row['kernels_in_flight']} | "
        f"{row['in_flight_s'] * 1e3:.2f} | "
        f"{row['call_busy_s'] * 1e3:.2f}{loose} | "
        f"{'-' if gbps is None else f'{gbps:,.0f}'} |")
  return lines


_registry.tables({
    ('scale_check', 'main'): scale_check_main,
    ('scale_1b', 'main'): scale_check_main,
    ('scale_8b', 'main'): scale_check_main,
    ('scale_sync', 'main'): scale_sync_main,
    ('scale_moe', 'main'): scale_check_main,
    ('outer_state_memory', 'main'): outer_state_memory_main,
    ('sharded_sync_bytes', 'main'): sharded_sync_bytes_main,
    ('overlap_gpu', 'main'): overlap_gpu_main,
    ('overlap_gpu_h100', 'main'): overlap_gpu_main,
})
