"""Renderer of docs/resilience.md's checkpoint-size table.

``experiments.checkpoint_size`` (the bytes of the reference run's newest
checkpoint, per item and per part of the saved state) writes the results
file; ``experiments.tables`` renders it with this.
"""

from typing import Any

from experiments import _registry

# Parts of the saved state smaller than this (raw bytes) share one row per
# tree (counters, step, input position, RNG, fault counters).
SMALL = 1024


def _n(n: float) -> str:
  return f'{n:,.0f}'


def _name(part: str, tree: str) -> str:
  return part[len(tree) + 1:].replace('/', '.')


def _part_rows(parts: dict[str, dict[str, int]]) -> list[str]:
  """One row per part of the saved state, the small ones of each tree
  merged; ``shared`` first."""
  rows = []
  for tree in ('shared', 'per_worker'):
    mine = {k: v for k, v in parts.items() if k.split('/')[0] == tree}
    small = [k for k, v in mine.items() if v['raw_bytes'] < SMALL]
    for k, v in mine.items():
      if k not in small:
        rows.append(f'| `{tree}`: `{_name(k, tree)}` | {v["arrays"]} '
                    f'| {_n(v["raw_bytes"])} | {_n(v["stored_bytes"])} |')
    if small:
      names = ', '.join(f'`{_name(k, tree)}`' for k in small)
      total = {f: sum(mine[k][f] for k in small)
               for f in ('arrays', 'raw_bytes', 'stored_bytes')}
      rows.append(f'| `{tree}`: {names} | {total["arrays"]} '
                  f'| {_n(total["raw_bytes"])} '
                  f'| {_n(total["stored_bytes"])} |')
  return rows


def _state_rows(entries: dict[str, int]) -> list[str]:
  """The ``state`` item's bytes by what its entries hold."""
  groups = {
      "process 0's OCDBT store (`ocdbt.process_0/`: the arrays, their "
      'zarr metadata, b-tree nodes)': ('ocdbt.process_0',),
      'the root OCDBT manifest and index (`manifest.ocdbt`, `d/`)':
          ('manifest.ocdbt', 'd'),
      "Orbax's tree metadata (`_METADATA`, `_sharding`, "
      '`array_metadatas/`)': ('_METADATA', '_sharding', 'array_metadatas'),
  }
  rows, seen = [], set()
  for label, names in groups.items():
    seen |= set(names)
    rows.append(f'| `state`: {label} '
                f'| {_n(sum(entries.get(k, 0) for k in names))} |')
  rest = {k: v for k, v in entries.items() if k not in seen}
  if rest:
    rows.append(f'| `state`: {", ".join(f"`{k}`" for k in rest)} '
                f'| {_n(sum(rest.values()))} |')
  return rows


def checkpoint_size_main(data: dict[str, Any]) -> str:
  """The step directory's bytes per entry; the saved state's raw and stored
  bytes per part; what every worker's copy of the shared fields would add
  (computed)."""
  res = data['results']
  s, e, c = res['setup'], res['entries'], res['computed']
  parts = res['parts']
  orbax = {k: v for k, v in e.items() if k not in ('state', 'layout',
                                                   'config')}
  total = {f: sum(v[f] for v in parts.values())
           for f in ('arrays', 'raw_bytes', 'stored_bytes')}
  lines = [
      f'`{s["config"]}`: {s["num_params"]:,} parameters, {s["workers"]} '
      f'workers, `{s["inner"]}` inner, {s["outer"]} outer (lr '
      f'{s["outer_learning_rate"]:g}, momentum {s["outer_momentum"]:g}); '
      f'the checkpoint of step {res["step"]} (`checkpoints/{res["step"]}/`'
      f', one every {s["checkpoint_every"]} steps), measured on disk.', '',
      '| what | bytes |', '|---|---:|',
      f'| the step directory, `du -sb` | **{_n(res["du_sb_bytes"])}** |',
      f'| its files (without the directories\' own entries) '
      f'| {_n(res["total_bytes"])} |',
      *_state_rows(res['state_entries']),
      f'| `layout` | {_n(e.get("layout", 0))} |',
      f'| `config` | {_n(e["config"])} |',
      f'| Orbax\'s step files ({", ".join(f"`{k}`" for k in orbax)}) '
      f'| {_n(sum(orbax.values()))} |', '',
      'The arrays of `state` by part of the saved tree '
      '(`loc_opt.train.layout`): raw bytes (shape x item size) and the '
      'bytes of their values in the OCDBT store (zstd-compressed zarr '
      'chunks and their `.zarray`).', '',
      '| part of `state` | arrays | raw bytes | stored bytes |',
      '|---|---:|---:|---:|',
      *_part_rows(parts),
      f'| all | {total["arrays"]} | {_n(total["raw_bytes"])} '
      f'| {_n(total["stored_bytes"])} |', '',
      'Computed from shapes, not measured: storing every worker\'s copy of '
      f'the shared anchor and outer state would add {c["extra_copies"]} x '
      f'{_n(c["shared_raw_bytes"])} = '
      f'{_n(c["extra_raw_bytes_if_per_worker"])} raw bytes '
      f'({s["num_params"]:,} parameters x 4 B x 2 x {c["extra_copies"]}), '
      'before compression.']
  return '\n'.join(lines) + '\n'


_registry.tables({
    ('checkpoint_size', 'main'): checkpoint_size_main,
})
