"""Writes dp_{streaming,eager,co2}.window.hlo.gz here: the windows of
tests/outer/test_overlap.py (the 4 -> 3 model) on 4 workers x 2
data-parallel H100s, compiled without a GPU with overlap.COMPILER_OPTIONS.

Needs JAX's CUDA plugin (the venv of `make overlap-gpu`):

  JAX_PLATFORMS=cpu PYTHONPATH=. .venv-cuda/bin/python \
      tests/parallel/gpu_hlo/make_dp_windows.py
"""

import gzip
import pathlib

import jax
from jax.experimental import topologies
import optax

from loc_opt import outer
from loc_opt import parallel
from loc_opt.parallel import overlap
from tests import optax_conformance as conf
from tests.outer import _helpers as helpers

HERE = pathlib.Path(__file__).parent
TARGET = HERE.parents[2] / 'experiments/reference/h100_target_config.pbtxt'
WINDOWS = {  # name: (transform, phases), as tests/outer/test_overlap.py
    'streaming': (outer.streaming_diloco(
        optax.adam(1e-2), sync_every=8, fragments={'w': 1, 'b': 0},
        overlap=2), ((1, None), False, (None, 1))),
    'eager': (outer.eager_diloco(optax.adam(1e-2), sync_every=3),
              (True, False, False)),
    'co2': (outer.co2(optax.sgd(0.1), sync_every=3), (True, False, False)),
}


def main():
  devices = topologies.get_topology_desc(
      '', 'cuda', target_config=TARGET.read_text(), topology='1x1x8').devices
  mesh = parallel.make_worker_mesh(4, data=2, devices=devices)

  def spec(tree, *axes):
    sharding = jax.NamedSharding(mesh, jax.P(*axes))
    return jax.tree.map(lambda s: jax.ShapeDtypeStruct(
        s.shape, s.dtype, sharding=sharding), tree)

  for name, (tx, phases) in WINDOWS.items():
    def step(carry, batch, phase, tx=tx):
      return helpers.train_step(tx, phase)(*carry, batch), None

    window = overlap.overlap_window(step, phases)
    params = jax.eval_shape(lambda: helpers.stack(conf.example_params()))
    state = jax.eval_shape(jax.vmap(tx.init), params)
    batches = tuple(jax.eval_shape(lambda i=i: helpers.worker_batches(i))
                    for i in range(len(phases)))
    fn = jax.jit(parallel.shard_map_workers(
        lambda carry, xs, w=window: w(carry, xs)[0], mesh))
    compiled = fn.lower(
        (spec(params, 'worker'), spec(state, 'worker')),
        spec(batches, 'worker', 'data')).compile(
            compiler_options=overlap.COMPILER_OPTIONS)
    path = HERE / f'dp_{name}.window.hlo.gz'
    path.write_bytes(gzip.compress(compiled.as_text().encode()))
    print('wrote', path)


if __name__ == '__main__':
  main()
