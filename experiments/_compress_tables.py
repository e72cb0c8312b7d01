"""Renderers of the compression tables of docs/benchmarks.md.

``experiments.compression_tradeoff`` (final eval loss against cross-worker
bytes, with and without compression) and ``experiments.muloco`` (MuLoCo
against its baselines, bytes and bits per sync) write the results files;
their ``results`` are lists of rows, one per run, and the setup line is
read from the runs' configs. ``experiments.tables`` renders them with
these, and the two programs print their tables with them.
"""

import pathlib
from typing import Any

from experiments import _registry

# The fp32 references of the compressed runs, by family: the per-worker
# fp32 mean the compressed data-parallel runs build on, and fp32 DiLoCo.
FP32_REFERENCES = ('dp_none', 'diloco')


def _config(data: dict[str, Any]) -> dict[str, Any] | None:
  """The config of the first run behind a row of ``data`` (the settings
  the runs share: steps, batch, mesh, H), or None without runs."""
  labels = {r['label'] for r in data['results']}
  runs = [run for run in data.get('runs', []) if run['label'] in labels]
  return runs[0]['config'] if runs else None


def _ratio(row: dict[str, Any], ref: dict[str, Any] | None) -> str:
  """Bytes of ``row`` against those of its fp32 reference ``ref``."""
  if ref is None:
    return '-'
  if ref is row:
    return '1.0x (reference)'
  factor = ref['cross_worker_bytes'] / row['cross_worker_bytes']
  return f'{factor:.1f}x less' if factor >= 1 else f'{1 / factor:.1f}x more'


def compression_tradeoff_main(data: dict[str, Any]) -> str:
  """Final eval loss and cross-worker bytes per run, and the bytes against
  the fp32 reference of the run's family."""
  rows = data['results']
  lines = []
  c = _config(data)
  if c is not None:
    m = c['mesh']
    tokens = c['num_steps'] * c['batch_size'] * c['data']['seq_len']
    lines += [f'{c["num_steps"]} steps x {c["batch_size"]} x '
              f'{c["data"]["seq_len"]} = {tokens:,} tokens; {m["workers"]} '
              f'workers x {m["data"] * m["fsdp"] * m["tensor"]} devices; '
              f'DiLoCo H = {c["outer"]["sync_every"]}', '']
  lines += ['| run | final eval loss | cross-worker bytes | vs its fp32 '
            'reference |', '|---|---|---|---|']
  refs = {r['family']: r for r in rows if r['name'] in FP32_REFERENCES}
  for r in rows:
    lines.append(f'| {r["label"]} | {r["final_eval_loss"]:.4f} | '
                 f'{r["cross_worker_bytes"]:,} | '
                 f'{_ratio(r, refs.get(r["family"]))} |')
  return '\n'.join(lines) + '\n'


def compression_figure(data: dict[str, Any], path: pathlib.Path) -> None:
  """Final eval loss against the whole run's cross-worker bytes, one
  marker per family (data-parallel, DiLoCo)."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  rows = data['results']
  fig, ax = plt.subplots(figsize=(7, 4.5))
  for family, marker in (('data-parallel', 'o'), ('DiLoCo', 's')):
    pts = [r for r in rows if r['family'] == family]
    ax.scatter([r['cross_worker_bytes'] for r in pts],
               [r['final_eval_loss'] for r in pts], marker=marker,
               label=family)
    for r in pts:
      ax.annotate(r['label'].split(', ', 1)[-1],
                  (r['cross_worker_bytes'], r['final_eval_loss']),
                  textcoords='offset points', xytext=(4, 4), fontsize=8)
  ax.set_xscale('log')
  ax.set_xlabel('cross-worker bytes, whole run (all devices)')
  ax.set_ylabel('final eval loss')
  ax.grid(True, alpha=0.3)
  ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def _num_params(rows: list[dict[str, Any]]) -> int | None:
  """The model's parameters, from a row's bytes and bits per sync (the
  rows hold ``bits = 8 bytes / num_params``)."""
  for r in rows:
    if r['bits_per_param_per_sync'] > 0:
      return round(8 * r['bytes_per_worker_per_sync']
                   / r['bits_per_param_per_sync'])
  return None


def muloco_main(data: dict[str, Any]) -> str:
  """Final eval loss, total cross-worker bytes, and the bytes and bits per
  parameter one worker sends per sync, per run."""
  rows = data['results']
  lines = []
  c, n = _config(data), _num_params(rows)
  if c is not None:
    tokens = c['num_steps'] * c['batch_size'] * c['data']['seq_len']
    model = f'; model {n:,} params' if n is not None else ''
    lines += [f'{tokens:,} tokens per run ({c["num_steps"]} steps x '
              f'{c["batch_size"]} x {c["data"]["seq_len"]}); '
              f'{c["mesh"]["workers"]} workers; H = '
              f'{c["outer"]["sync_every"]}{model}. Bytes are cross-worker '
              'bytes read from the compiled programs; per sync = per step '
              'for data parallelism.', '']
  lines += ['| run | final eval loss | total cross-worker bytes | bytes / '
            'worker / sync | bits / param / sync |', '|---|---|---|---|---|']
  for r in rows:
    lines.append(f'| {r["label"]} | {r["final_eval_loss"]:.4f} | '
                 f'{r["cross_worker_bytes"]:,} | '
                 f'{r["bytes_per_worker_per_sync"]:,.0f} | '
                 f'{r["bits_per_param_per_sync"]:.2f} |')
  return '\n'.join(lines) + '\n'


_registry.tables({
    ('compression_tradeoff', 'main'): compression_tradeoff_main,
    ('muloco', 'main'): muloco_main,
})
_registry.figure('compression_tradeoff', compression_figure,
                 'figures/compression_loss_vs_bytes.png')
