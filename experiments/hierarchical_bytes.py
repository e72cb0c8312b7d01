r"""Hierarchical DiLoCo's bytes, read from the compiled programs.

Two tables of docs/hierarchical.md, computed as
``tests/outer/test_hierarchical_codec.py`` and
``tests/outer/test_hierarchical.py`` compute them (``hierarchical_diloco``
with Adam inside, ``sync_every=2``, ``global_sync_every=4``, each phase's
step compiled under ``shard_map`` on 4 workers x 2 data-parallel devices,
collectives read by ``loc_opt.parallel.collective_bytes``):

* ``codec``: the group-sync program (phase ``'group'``) of a 2,560-parameter
  model ``{'w': (32, 64), 'v': (16, 32)}`` per group codec, at groups of
  ``G = 2`` and ``G = 4``: the codec's payload per worker
  (``compressor.payload_bytes``; fp32 bytes without a codec) and the
  cross-worker bytes per worker, with their kinds and the bytes that join
  two groups.
* ``phases``: each phase's program at ``G = 2`` for a 136-parameter model
  ``{'w': (16, 8), 'b': (8,)}`` (inner, group sync, global sync, the global
  sync with ``global_exchange='representatives'``), and flat
  DiLoCo's sync (``reduce_fn=parallel.worker_mean()``) for comparison: the
  cross-worker collectives by kind, the sets of workers each joins and the
  bytes between the two groups.

  python -m experiments.hierarchical_bytes --workdir=DIR

Writes ``hierarchical_bytes.md`` and the results file
``hierarchical_bytes.json`` to --workdir. Compile only; under a minute on 2
CPU cores.
"""

import functools

from absl import app, flags

from experiments import _runs

_WORKDIR = flags.DEFINE_string('workdir', None, 'Where results go.')
_CPU_DEVICES = flags.DEFINE_integer('cpu_devices', 8, 'Virtual CPU devices.')
flags.mark_flag_as_required('workdir')

M = 4  # Workers.
DATA = 2  # Data-parallel devices per worker.
# Leaf sizes that fill whole int8 blocks on each of a worker's 2 devices.
CODEC_SHAPES = {'w': (32, 64), 'v': (16, 32)}
# (label, group_codec) of the codec table; None: the fp32 group mean.
CODECS = (('none (fp32)', None),
          ("`'int8'` (blocks of 256)", 'int8'),
          ("`('int8', {'block_size': None})` (per tensor)",
           ('int8', {'block_size': None})),
          ("`('statistical', {'bits': 2})`", ('statistical', {'bits': 2})))
GROUP_SIZES = (2, 4)
TILE_SHAPES = {'w': (16, 8), 'b': (8,)}
PHASE_GROUP_SIZE = 2


def _hier(g, **kwargs):
  import optax  # pylint: disable=g-import-not-at-top

  import loc_opt  # pylint: disable=g-import-not-at-top
  return loc_opt.outer.hierarchical_diloco(
      optax.adam(1e-2), sync_every=2, global_sync_every=4, group_size=g,
      **kwargs)


def _stack(tree):
  """``tree`` broadcast to ``M`` identical workers (a leading axis)."""
  from loc_opt import parallel  # pylint: disable=g-import-not-at-top
  return parallel.replicate(tree, M)


def _row(report, g) -> dict:
  """Per worker: cross-worker bytes by kind, bytes joining two groups of
  ``g``, and each unconditional cross-worker collective's worker sets."""
  return {
      'kinds': {k: v / M for k, v in
                report.by_kind(cross_worker=True).items()},
      'cross_worker_bytes': report.cross_worker_bytes_per_worker,
      'cross_group_bytes': report.cross_group_bytes(g) / M,
      'collectives': [
          {'kind': c.kind, 'shape': c.shape,
           'bytes_per_worker': c.total_bytes / M,
           'worker_groups': [list(w) for w in c.worker_groups]}
          for c in report.collectives if c.cross_worker and c.branch is None]}


def _codec_table(mesh) -> dict:
  """One row per group codec of :data:`CODECS`, at each group size."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top

  from loc_opt import compression  # pylint: disable=g-import-not-at-top
  params = {k: jnp.ones(s) for k, s in CODEC_SHAPES.items()}
  rows = []
  for label, scheme in CODECS:
    payload = (sum(x.nbytes for x in jax.tree.leaves(params)) if scheme
               is None else compression.as_compressor(scheme).payload_bytes(
                   params))
    row = {'label': label, 'group_codec': scheme, 'payload_bytes': payload,
           'by_group_size': {}}
    for g in GROUP_SIZES:
      kwargs = {} if scheme is None else {'group_codec': scheme}
      report = _runs.step_report(_hier(g, **kwargs), _stack(params),
                                 'group', mesh)
      row['by_group_size'][str(g)] = _row(report, g)
      print(f'{label}, G = {g}: {row["by_group_size"][str(g)]["kinds"]}',
            flush=True)
    rows.append(row)
  num_params = sum(x.size for x in jax.tree.leaves(params))
  return {'setup': {'workers': M, 'devices_per_worker': DATA,
                    'num_params': num_params,
                    'shapes': {k: list(s) for k, s in CODEC_SHAPES.items()},
                    'group_sizes': list(GROUP_SIZES)},
          'rows': rows}


def _phases_table(mesh) -> dict:
  """One row per phase of ``hierarchical_diloco`` at groups of
  :data:`PHASE_GROUP_SIZE`, then flat DiLoCo's sync."""
  import jax  # pylint: disable=g-import-not-at-top
  import optax  # pylint: disable=g-import-not-at-top

  import loc_opt  # pylint: disable=g-import-not-at-top
  from loc_opt import parallel  # pylint: disable=g-import-not-at-top
  from loc_opt.outer import hierarchical  # pylint: disable=g-import-not-at-top
  keys = jax.random.split(jax.random.key(0), len(TILE_SHAPES))
  tile = {k: jax.random.normal(key, s) for key, (k, s) in
          zip(keys, sorted(TILE_SHAPES.items()))}
  params, g = _stack(tile), PHASE_GROUP_SIZE
  names = {False: 'inner', 'group': "`'group'`", 'global': "`'global'`"}
  rows = []
  for phase in hierarchical.PHASES:
    report = _runs.step_report(_hier(g), params, phase, mesh)
    rows.append({'phase': names.get(phase, str(phase)), **_row(report, g)})
  # TreeLoCo: only each group's first worker sends across groups.
  report = _runs.step_report(_hier(g, global_exchange='representatives'),
                             params, 'global', mesh)
  rows.append({'phase': "`'global'`, TreeLoCo (one representative per "
                        'group)', **_row(report, g)})
  flat = loc_opt.diloco(optax.adam(1e-2), sync_every=4,
                        reduce_fn=parallel.worker_mean())
  rows.append({'phase': 'flat DiLoCo sync',
               **_row(_runs.step_report(flat, params, True, mesh), g)})
  for r in rows:
    print(f'{r["phase"]}: {r["kinds"]}, between groups '
          f'{r["cross_group_bytes"]:g}', flush=True)
  num_params = sum(x.size for x in jax.tree.leaves(tile))
  return {'setup': {'workers': M, 'devices_per_worker': DATA,
                    'group_size': g, 'num_params': num_params,
                    'shapes': {k: list(s) for k, s in TILE_SHAPES.items()}},
          'rows': rows}


def main(argv):
  del argv
  _runs.setup(_CPU_DEVICES.value)
  from experiments import tables  # pylint: disable=g-import-not-at-top
  from loc_opt import parallel  # pylint: disable=g-import-not-at-top
  mesh = parallel.make_worker_mesh(M, data=DATA)
  results = {'codec': _codec_table(mesh), 'phases': _phases_table(mesh)}
  render = functools.partial(tables.render, 'hierarchical_bytes',
                             data={'results': results})
  _runs.write(_WORKDIR.value, 'hierarchical_bytes',
              render('codec') + '\n' + render('phases'), results)


if __name__ == '__main__':
  app.run(main)
