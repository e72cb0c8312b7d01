r"""Bytes on the wire of every registered codec and compressor.

Compiles one data-parallel step with ``compressed_all_reduce`` for each
scheme on a 4-worker x 2-device mesh of virtual CPU devices, reads the
cross-worker bytes from the compiled HLO (``collective_bytes``) and prints
them next to the scheme's theoretical payload and the fp32 bytes; with
--workdir, also writes ``wire_bytes.md`` and the results file
``wire_bytes.json`` (numbers, provenance) there.

  python -m experiments.wire_bytes [--rows=512 --cols=512] [--workdir=DIR]
"""

from absl import app
from absl import flags

from experiments import _runs
from experiments import tables

_ROWS = flags.DEFINE_integer('rows', 512, 'Rows of the weight matrix.')
_COLS = flags.DEFINE_integer('cols', 512, 'Columns of the weight matrix.')
_CPU_DEVICES = flags.DEFINE_integer('cpu_devices', 8, 'Virtual CPU devices.')
_WORKDIR = flags.DEFINE_string('workdir', '',
                               'Where to write the results file (optional).')

# name -> factory kwargs (defaults otherwise)
KWARGS = {
    'topk': {'density': 0.01},
    'topk_chunked': {'density': 0.01, 'chunk': 4096, 'index_dtype': 'uint12'},
    'randomk': {'density': 0.01},
    'powersgd': {'rank': 4},
    'dgc': {'density': 0.01},
}
EXTRA = {
    'topk_chunked 1% + two_bit values': (
        'topk_chunked', {'density': 0.01, 'chunk': 4096,
                         'index_dtype': 'uint12', 'value_codec': 'two_bit'}),
}


def main(argv):
  del argv
  _runs.setup(_CPU_DEVICES.value)
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from loc_opt import compression  # pylint: disable=g-import-not-at-top
  from loc_opt import parallel  # pylint: disable=g-import-not-at-top

  workers = 4
  mesh = parallel.make_worker_mesh(workers, data=2)
  shapes = {'w': (_ROWS.value, _COLS.value), 'b': (_COLS.value,)}
  n = sum(int(jnp.prod(jnp.array(s))) for s in shapes.values())
  one = {k: jnp.zeros(s) for k, s in shapes.items()}
  sharding = jax.NamedSharding(mesh, jax.P('worker'))
  params = jax.device_put(
      {k: jnp.zeros((workers,) + s) for k, s in shapes.items()}, sharding)
  schemes = {name: (name, KWARGS.get(name, {}))
             for name in sorted(set(compression.CODECS) |
                                set(compression.COMPRESSORS))}
  schemes.update(EXTRA)
  rows = []
  for label, (name, kwargs) in schemes.items():
    scheme = compression.make_compressor(name, **kwargs)
    tx = compression.compressed_all_reduce(scheme, 'worker')
    state = jax.jit(jax.vmap(tx.init))(params)
    step = jax.jit(parallel.shard_map_workers(tx.update, mesh))
    report = parallel.collective_bytes(
        step.lower(params, state, params).compile(), mesh)
    rows.append({'label': label, 'scheme': name, 'kwargs': kwargs,
                 'measured_bytes_per_worker':
                     float(report.cross_worker_bytes_per_worker),
                 'theory_bytes': int(scheme.payload_bytes(one))})
    print(f'{label}: {rows[-1]["measured_bytes_per_worker"]:,.0f} B',
          flush=True)
  results = {'setup': {'rows': _ROWS.value, 'cols': _COLS.value,
                       'num_params': n, 'workers': workers,
                       'devices_per_worker': 2},
             'rows': rows}
  markdown = tables.render('wire_bytes', 'main', {'results': results})
  if _WORKDIR.value:
    _runs.write(_WORKDIR.value, 'wire_bytes', markdown, results)
  else:
    print('\n' + markdown)


if __name__ == '__main__':
  app.run(main)
