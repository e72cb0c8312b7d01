r"""DiLoCo's sync, replicated against sharded outer state: bytes read from
the compiled programs.

The table of docs/sharding.md ("The sharded sync under FSDP"): for each row
the sync step compiled with the outer state replicated and with it sharded
over the workers (each device reduce-scattering and all-gathering its own
block of every leaf), its cross-worker collectives read from the compiled
HLO by ``loc_opt.parallel.collective_bytes`` (operand bytes):

* the trainer (``loc_opt.train.build_experiment``, ``outer.state_layout``
  ``'replicated'`` / ``'sharded'``) on ``tests/train``'s tiny 1-block
  Transformer LM (``tiny_config(model='transformer')``, rebuilt here) on
  meshes 4x2x1x1 and 4x1x2x1: the sync step's cross-worker bytes, all
  devices (``exp.programs.bytes_per_step``), and beside them the
  within-worker bytes of the sync and of the inner step;
* the transform alone on ``configs/scale_lm.py:1b``'s parameters (abstract,
  nothing materialized) on its mesh 2x1x4x1: ``diloco(optax.adamw(1e-3),
  outer_state_layout=...)``, the sharded layout with the model's
  ``param_specs`` as the trainer passes them, its sync step under the
  workers' ``shard_map`` with the state laid out like its parameter inside
  a worker (as ``experiments.outer_state_memory --compile`` builds it):
  bytes per device by collective kind.

  python -m experiments.sharded_sync_bytes --workdir=DIR

Writes ``sharded_sync_bytes.md`` and the results file
``sharded_sync_bytes.json`` to --workdir. Compile only, 8 virtual CPU
devices: six compiles of the tiny LM's steps and two of the ~1B sync step,
about 2.5 minutes on 2 CPU cores.
"""

import math
import time

from absl import app, flags

from experiments import _runs

_WORKDIR = flags.DEFINE_string('workdir', None, 'Where results go.')
_CPU_DEVICES = flags.DEFINE_integer('cpu_devices', 8, 'Virtual CPU devices.')
flags.mark_flag_as_required('workdir')

LAYOUTS = ('replicated', 'sharded')
# The trainer rows' meshes (w, d, f, t).
TRAINER_MESHES = ((4, 2, 1, 1), (4, 1, 2, 1))
TINY_LM = ("tiny 1-block Transformer LM (`tests/train`'s "
           "`tiny_config(model='transformer')`)")


def _mesh_name(workers, data, fsdp, tensor) -> str:
  return f'{workers}x{data}x{fsdp}x{tensor}'


def _tiny_lm(mesh, layout):
  """``tests/train/_helpers.py``'s ``tiny_config(model='transformer')``
  (the fields that shape the compiled steps) on ``mesh``, outer state
  ``layout``."""
  from configs import diloco_lm  # pylint: disable=g-import-not-at-top
  from loc_opt.train import config as cfg_lib  # pylint: disable=g-import-not-at-top
  c = diloco_lm.get_config('transformer')
  c.num_steps = 12
  c.batch_size = 16
  c.data.eval_batch_size = 16
  c.model.d_model = 32
  c.model.num_heads = 2
  c.model.num_layers = 1
  c.model.d_ff = 64
  c.model.max_len = 32
  c.data.seq_len = 32
  c.outer.sync_every = 4
  c.optimizer.schedule = 'constant'
  c.optimizer.schedule_kwargs = {}
  workers, data, fsdp, tensor = mesh
  return cfg_lib.with_overrides(c, {
      'mesh.workers': workers, 'mesh.data': data, 'mesh.fsdp': fsdp,
      'mesh.tensor': tensor, 'outer.state_layout': layout})


def _trainer_row(mesh) -> dict:
  """Per layout: the trainer's sync step's cross-worker bytes (all
  devices, and by kind), its within-worker bytes and the inner step's."""
  from loc_opt.train import experiment as exp_lib  # pylint: disable=g-import-not-at-top
  row = {'program': 'trainer', 'model': TINY_LM, 'mesh': _mesh_name(*mesh),
         'unit': 'bytes per sync, all devices'}
  for layout in LAYOUTS:
    t0 = time.time()
    exp = exp_lib.build_experiment(_tiny_lm(mesh, layout))
    steps = exp.programs.steps
    steps[True], steps[False]  # pylint: disable=pointless-statement
    sync, inner = steps.reports[True], steps.reports[False]
    row[layout] = {
        'cross_worker_bytes': int(sync.cross_worker_bytes),
        'kinds': sync.by_kind(True),
        'within_worker_bytes': int(sync.within_worker_bytes),
        'inner_cross_worker_bytes': int(inner.cross_worker_bytes),
        'inner_within_worker_bytes': int(inner.within_worker_bytes),
        'num_params': exp.model.num_params,
        'compile_seconds': time.time() - t0}
    print(f'trainer {row["mesh"]} {layout}: {row[layout]}', flush=True)
  return row


def _transform_row(module: str, arg: str) -> dict:
  """Per layout: the transform-alone sync step's cross-worker bytes per
  device by kind, for config ``configs/<module>.py:<arg>``."""
  import importlib  # pylint: disable=g-import-not-at-top

  import jax  # pylint: disable=g-import-not-at-top
  import optax  # pylint: disable=g-import-not-at-top

  import loc_opt  # pylint: disable=g-import-not-at-top
  from loc_opt import models  # pylint: disable=g-import-not-at-top
  from loc_opt import parallel  # pylint: disable=g-import-not-at-top
  config = importlib.import_module(f'configs.{module}').get_config(arg)
  m = config.mesh
  shape = (m.workers, m.data, m.fsdp, m.tensor)
  mesh = parallel.make_worker_mesh(*shape)
  devices = math.prod(mesh.shape.values())
  model = models.build_model(config.model)
  abstract = jax.eval_shape(model.init, jax.random.key(0))
  specs = models.resolve_specs(model.specs,
                               ('worker', 'data', 'fsdp', 'tensor'))
  params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(
      (m.workers, *x.shape), x.dtype), abstract)
  row = {'program': 'transform', 'model': f'`{module}.py:{arg}`',
         'mesh': _mesh_name(*shape), 'unit': 'bytes/device',
         'num_params': model.num_params}
  for layout in LAYOUTS:
    t0 = time.time()
    kwargs = {'param_specs': specs} if layout == 'sharded' else {}
    tx = loc_opt.diloco(optax.adamw(1e-3),
                        sync_every=config.outer.sync_every,
                        outer_state_layout=layout, **kwargs)
    opt = jax.eval_shape(
        parallel.vmap_workers(lambda p, tx=tx: (tx.init(p),)), params)[0]
    p_shard, s_shard = _runs.state_shardings(params, opt, specs, mesh)

    def step(params, state, grads, tx=tx):
      updates, state = tx.update(grads, state, params, sync=True)
      return optax.apply_updates(params, updates), state

    fn = jax.jit(parallel.shard_map_workers(step, mesh),
                 in_shardings=(p_shard, s_shard, p_shard),
                 out_shardings=(p_shard, s_shard))
    report = parallel.collective_bytes(
        fn.lower(params, opt, params).compile(), mesh)
    row[layout] = {
        'cross_worker_bytes': int(report.cross_worker_bytes) // devices,
        'kinds': {k: v // devices for k, v in report.by_kind(True).items()},
        'within_worker_bytes': int(report.within_worker_bytes) // devices,
        'compile_seconds': time.time() - t0}
    print(f'transform {row["mesh"]} {layout}: {row[layout]}', flush=True)
  return row


def main(argv):
  del argv
  _runs.setup(_CPU_DEVICES.value)
  from experiments import tables  # pylint: disable=g-import-not-at-top
  rows = [_trainer_row(mesh) for mesh in TRAINER_MESHES]
  rows.append(_transform_row('scale_lm', '1b'))
  results = {'rows': rows}
  _runs.write(_WORKDIR.value, 'sharded_sync_bytes',
              tables.render('sharded_sync_bytes', 'main',
                            {'results': results}), results)


if __name__ == '__main__':
  app.run(main)
