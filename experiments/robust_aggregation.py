r"""Robust aggregation: the bytes of DiLoCo's sync under each rule, and one
adversarial worker.

Two tables of docs/robust_aggregation.md, computed as
``tests/outer/test_robust.py`` computes them:

* ``bytes``: the cross-worker collectives of DiLoCo's compiled sync program
  (``tx.update(..., sync=True)`` under ``shard_map`` on 4 workers x 2
  data-parallel devices, SGD inside, a 136-parameter model ``{'w': (16, 8),
  'b': (8,)}``) under each ``aggregate``, per worker by kind (read from the
  HLO by ``loc_opt.parallel.collective_bytes``), and the seconds they take
  one after another on a 1 Gbit/s link without latency
  (``loc_opt.parallel.transfers_seconds``). The mean is measured with
  ``reduce_fn=parallel.worker_mean()``, as in the test.
* ``adversary``: the anchor loss on held-out batches after 120 steps of 4
  workers (SGD inner, lr 0.1, H = 5, outer Nesterov 0.7 / 0.9) on the
  ``tanh`` regression of ``tests/outer/_helpers.py``; with the adversary,
  worker 3 flips and scales its gradients by -10.

  python -m experiments.robust_aggregation --workdir=DIR

Writes ``robust_aggregation.md`` and the results file
``robust_aggregation.json`` to --workdir. About a minute on 2 CPU cores.
"""

import functools

from absl import app, flags

from experiments import _runs

_WORKDIR = flags.DEFINE_string('workdir', None, 'Where results go.')
_CPU_DEVICES = flags.DEFINE_integer('cpu_devices', 8, 'Virtual CPU devices.')
flags.mark_flag_as_required('workdir')

M = 4  # Workers.
DATA = 2  # Data-parallel devices per worker.
LINK_GBPS = 1.0
# The model of the bytes table (tests/outer/_helpers.py's tile_params).
TILE_SHAPES = {'w': (16, 8), 'b': (8,)}
# (aggregate, codec) of the bytes table's rows; the mean's row is the
# first, the baseline of the seconds.
BYTES_ROWS = (('mean', None), ('median', None), ('trimmed_mean', None),
              ('norm_clipped_mean', None), ('median', 'int8'),
              ('trimmed_mean', 'int8'))
# (label, aggregate, adversary, codec) of the adversary table's runs.
ADVERSARY_ROWS = (
    ('honest, mean', 'mean', False, None),
    ('adversary, mean', 'mean', True, None),
    ('adversary, median', 'median', True, None),
    ('adversary, trimmed mean (trim 1)', 'trimmed_mean', True, None),
    ('adversary, norm-clipped mean (multiple 1)', 'norm_clipped_mean', True,
     None),
    ('adversary, median through int8', 'median', True, 'int8'),
)
STEPS = 120
SYNC_EVERY = 5


def _stack(tree):
  """``tree`` broadcast to ``M`` identical workers (a leading axis)."""
  from loc_opt import parallel  # pylint: disable=g-import-not-at-top
  return parallel.replicate(tree, M)


def _tile_params():
  import jax  # pylint: disable=g-import-not-at-top
  keys = jax.random.split(jax.random.key(0), len(TILE_SHAPES))
  return {k: jax.random.normal(key, s) for key, (k, s) in
          zip(keys, sorted(TILE_SHAPES.items()))}


def _sync_report(params, mesh, **kwargs):
  """Collectives of DiLoCo's compiled sync step on ``mesh`` (stacked
  ``params``, gradients shaped like them)."""
  import optax  # pylint: disable=g-import-not-at-top

  import loc_opt  # pylint: disable=g-import-not-at-top
  tx = loc_opt.diloco(optax.sgd(0.1), sync_every=4, **kwargs)
  return _runs.step_report(tx, params, True, mesh)


def _bytes_table() -> dict:
  """The setup and one row per (aggregate, codec) of :data:`BYTES_ROWS`."""
  import jax  # pylint: disable=g-import-not-at-top

  from loc_opt import parallel  # pylint: disable=g-import-not-at-top
  mesh = parallel.make_worker_mesh(M, data=DATA)
  params = _stack(_tile_params())
  link = parallel.Link(LINK_GBPS)
  rows = []
  for aggregate, codec in BYTES_ROWS:
    kwargs = ({'reduce_fn': parallel.worker_mean()} if aggregate == 'mean'
              else {'aggregate': aggregate})
    if codec is not None:
      kwargs['codec'] = codec
    report = _sync_report(params, mesh, **kwargs)
    transfers = parallel.cross_worker_transfers(report)
    rows.append({
        'aggregate': aggregate, 'codec': codec,
        'reduce_fn': ('parallel.worker_mean()' if aggregate == 'mean'
                      else None),
        'kinds': {k: v / M for k, v in
                  report.by_kind(cross_worker=True).items()},
        'collectives': [
            {'kind': c.kind, 'shape': c.shape,
             'bytes_per_worker': c.total_bytes / M}
            for c in report.collectives
            if c.cross_worker and c.branch is None],
        'seconds': parallel.transfers_seconds(transfers, M, link)})
    print(f'{aggregate} {codec or ""}: {rows[-1]["kinds"]}, '
          f'{rows[-1]["seconds"] * 1e6:.1f} us', flush=True)
  num_params = sum(x.size for x in jax.tree.leaves(_tile_params()))
  return {'setup': {'workers': M, 'devices_per_worker': DATA,
                    'num_params': num_params,
                    'shapes': {k: list(s) for k, s in TILE_SHAPES.items()},
                    'link_gbps': LINK_GBPS, 'latency_s': 0.0},
          'rows': rows}


# ------------------------------------------------ the adversarial worker ---
def _example_params():
  """The 4 -> 3 model (``w`` 4 x 3, ``b`` 3) of the adversary runs."""
  import jax  # pylint: disable=g-import-not-at-top
  k1, k2 = jax.random.split(jax.random.key(0))
  return {'w': jax.random.normal(k1, (4, 3)),
          'b': jax.random.normal(k2, (3,))}


def _quad_loss(params, batch):
  """``mean((tanh(x w) + b - y)^2)``."""
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  x, y = batch
  pred = jnp.tanh(x @ params['w']) + params['b']
  return jnp.mean((pred - y) ** 2)


def _worker_batches(step):
  """Per-worker batches of 8 of step ``step``."""
  import jax  # pylint: disable=g-import-not-at-top
  key = jax.random.fold_in(jax.random.key(42), step)
  kx, ky = jax.random.split(key)
  return (jax.random.normal(kx, (M, 8, 4)), jax.random.normal(ky, (M, 8, 3)))


def _eval_loss(params) -> float:
  """The loss on 4 held-out batches (steps 1000..1003, every worker's)."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  batches = [_worker_batches(1000 + i) for i in range(4)]
  return float(np.mean([
      _quad_loss(params, (x.reshape(-1, 4), y.reshape(-1, 3)))
      for x, y in batches]))


def _final_loss(aggregate, adversary, codec=None) -> float:
  """Anchor loss after :data:`STEPS` steps of ``M`` workers; with
  ``adversary`` worker ``M - 1`` flips and scales its gradients by -10.
  ``inf`` if the anchor is not finite."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  import optax  # pylint: disable=g-import-not-at-top

  import loc_opt  # pylint: disable=g-import-not-at-top
  from loc_opt import parallel  # pylint: disable=g-import-not-at-top
  kwargs = {} if codec is None else {'codec': codec}
  tx = loc_opt.diloco(optax.sgd(0.1), sync_every=SYNC_EVERY,
                      aggregate=aggregate, **kwargs)

  def step(params, state, batch):
    grads = jax.grad(_quad_loss)(params, batch)
    bad = adversary & (jax.lax.axis_index('worker') == M - 1)
    grads = jax.tree.map(lambda g: jnp.where(bad, -10.0 * g, g), grads)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  fn = jax.jit(parallel.vmap_workers(step))
  params = _stack(_example_params())
  state = jax.vmap(tx.init)(params)
  for i in range(STEPS):
    params, state = fn(params, state, _worker_batches(i))
  anchor = jax.tree.map(lambda x: x[0], state.anchor)
  finite = all(np.all(np.isfinite(x)) for x in jax.tree.leaves(anchor))
  return _eval_loss(anchor) if finite else float('inf')


def _adversary_table() -> dict:
  """The setup, the starting loss and one row per run of
  :data:`ADVERSARY_ROWS`."""
  rows = []
  for label, aggregate, adversary, codec in ADVERSARY_ROWS:
    loss = _final_loss(aggregate, adversary, codec)
    rows.append({'label': label, 'aggregate': aggregate,
                 'adversary': adversary, 'codec': codec,
                 'final_loss': loss})
    print(f'{label}: {loss:.4g}', flush=True)
  return {'setup': {'workers': M, 'steps': STEPS, 'sync_every': SYNC_EVERY,
                    'inner': 'sgd(0.1)', 'outer': 'nesterov(0.7, 0.9)',
                    'adversary_worker': M - 1, 'adversary_scale': -10.0},
          'start_loss': _eval_loss(_example_params()), 'rows': rows}


def main(argv):
  del argv
  _runs.setup(_CPU_DEVICES.value)
  from experiments import tables  # pylint: disable=g-import-not-at-top
  results = {'bytes': _bytes_table(), 'adversary': _adversary_table()}
  render = functools.partial(tables.render, 'robust_aggregation',
                             data={'results': results})
  _runs.write(_WORKDIR.value, 'robust_aggregation',
              render('bytes') + '\n' + render('adversary'), results)


if __name__ == '__main__':
  app.run(main)
