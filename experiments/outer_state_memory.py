r"""Per-device memory of DiLoCo's outer state: replicated, sharded, offloaded.

For a config's model (abstract parameters, nothing materialized) and mesh,
prints one Markdown row per layout: ``diloco(...,
outer_state_layout='replicated' | 'sharded')``, and ``'offloaded'``, the
replicated layout with the anchor and outer state in pinned host memory
between steps (``loc_opt.parallel.offloaded``; 0 device bytes at rest):
the anchor + Nesterov momentum bytes per device
derived from shapes (``loc_opt.outer.outer_state_bytes``): each leaf's
state divided like its parameter over the worker's FSDP / tensor devices
(the sharded layout's rows/M shards take the parameter's spec too), and
undivided inside the worker (every device of a worker holds its copy);
with ``--compile``, the compiled sync step of the transform alone (inner
AdamW, gradients fed in; the sharded layout with the model's
``param_specs``, as the trainer builds it) on the config's mesh, those
shardings as its
``in_shardings``: its per-device argument bytes from ``memory_analysis()``
(params, gradients, inner and outer state) and its cross-worker
collectives, bytes per device by kind.

  python -m experiments.outer_state_memory --compile   # the docs' configs
  python -m experiments.outer_state_memory --config=configs/scale_lm.py:1b \
    --compile

On a machine without accelerators it uses ``--cpu_devices`` virtual CPU
devices. Without --config it measures the configs of :data:`PRESETS` (the
reference LM and ``scale_lm.py:1b``, the table of docs/sharding.md). With
--workdir, also writes ``outer_state_memory.md`` and the results file
``outer_state_memory.json`` (rows, configs, provenance).
Reference: Rajbhandari et al., *ZeRO: Memory Optimizations Toward Training
Trillion Parameter Models*, 2020.
"""

import json
import math

from absl import app, flags
from ml_collections import config_flags

from experiments import _runs

_CONFIG = config_flags.DEFINE_config_file(
    'config', None, 'Config file (default: the configs of PRESETS).')
_CPU_DEVICES = flags.DEFINE_integer('cpu_devices', 8, 'Virtual CPU devices.')
_WORKDIR = flags.DEFINE_string(
    'workdir', '', 'Also write the results file outer_state_memory.json here.')
_COMPILE = flags.DEFINE_bool('compile', False,
                             'Also compile the sync step of each layout.')

HEADER = ('| layout | outer state MiB/dev | MiB/dev if not split in worker '
          '| compiled args MiB/dev | sync collectives (bytes/dev) |')


def _compiled(config, layout, abstract, specs, mesh):
  """(argument bytes per device, collectives by kind) of the sync step;
  layout ``'offloaded'``: the replicated layout with the anchor and outer
  state in ``pinned_host`` memory, moved to the device for the step."""
  import jax  # pylint: disable=g-import-not-at-top
  import optax  # pylint: disable=g-import-not-at-top

  import loc_opt  # pylint: disable=g-import-not-at-top
  from loc_opt import parallel  # pylint: disable=g-import-not-at-top
  offload = layout == 'offloaded'
  # The sharded sync runs each leaf's collectives on each device's block
  # (param_specs), as the trainer builds it.
  kwargs = {'param_specs': specs} if layout == 'sharded' else {}
  tx = loc_opt.diloco(optax.adamw(1e-3), sync_every=config.outer.sync_every,
                      outer_state_layout='replicated' if offload else layout,
                      **kwargs)
  params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(
      (config.mesh.workers, *x.shape), x.dtype), abstract)
  opt = jax.eval_shape(parallel.vmap_workers(lambda p: (tx.init(p),)),
                       params)[0]
  p_shard, on_device = _runs.state_shardings(params, opt, specs, mesh)
  at_rest = parallel.host_shardings(on_device, ('anchor', 'outer_state')
                                    ) if offload else on_device

  def step(params, state, grads):
    updates, state = tx.update(grads, state, params, sync=True)
    return optax.apply_updates(params, updates), state

  program = parallel.offloaded(parallel.shard_map_workers(step, mesh),
                               on_device, at_rest)
  fn = jax.jit(program, in_shardings=(p_shard, at_rest, p_shard),
               out_shardings=(p_shard, at_rest))
  compiled = fn.lower(params, opt, params).compile()
  report = parallel.collective_bytes(compiled, mesh)
  devices = math.prod(mesh.shape.values())
  kinds = {k: v // devices for k, v in report.by_kind(True).items()}
  return compiled.memory_analysis().argument_size_in_bytes, kinds


# The configs of docs/sharding.md's table, run when --config is not given:
# (label, module under configs/, its argument).
PRESETS = (('reference LM', 'diloco_lm', None),
           ('`scale_lm.py:1b`', 'scale_lm', '1b'))


def _measure(config, label: str) -> tuple[list[dict], int]:
  """The rows of ``config`` (one per layout) and its parameter count."""
  import jax  # pylint: disable=g-import-not-at-top

  from loc_opt import (
    models,  # pylint: disable=g-import-not-at-top
    outer,  # pylint: disable=g-import-not-at-top
    parallel,  # pylint: disable=g-import-not-at-top
  )
  m = config.mesh
  model = models.build_model(config.model)
  abstract = jax.eval_shape(model.init, jax.random.key(0))
  names = ('worker', 'data', 'fsdp', 'tensor')
  specs = models.resolve_specs(model.specs, names)
  sizes = dict(zip(names, (m.workers, m.data, m.fsdp, m.tensor)))

  def divisor(spec):
    axes = [a for entry in spec if entry is not None
            for a in (entry if isinstance(entry, tuple) else (entry,))]
    return math.prod(sizes[a] for a in axes)

  divisors = jax.tree.map(divisor, specs, is_leaf=lambda x: isinstance(
      x, jax.P))
  mib = lambda b: f'{b / 2**20:,.1f}'
  mesh_name = f'{m.workers}x{m.data}x{m.fsdp}x{m.tensor}'
  print(f'# {label}: {model.num_params / 1e6:,.1f}M parameters, mesh '
        f'(w x d x f x t) {mesh_name}\n{HEADER}\n'
        + '|---' * (HEADER.count('|') - 1) + '|', flush=True)
  rows = []
  for layout in ('replicated', 'sharded', 'offloaded'):
    kept = 'replicated' if layout == 'offloaded' else layout
    here = outer.outer_state_bytes(abstract, m.workers, layout=kept,
                                   divisors=divisors)
    unsplit = outer.outer_state_bytes(abstract, m.workers, layout=kept)
    host = 0
    if layout == 'offloaded':  # On the host between syncs.
      here, host, unsplit = 0, here, 0
    nbytes, kinds = None, None
    if _COMPILE.value:
      mesh = parallel.make_worker_mesh(m.workers, m.data, m.fsdp, m.tensor)
      nbytes, kinds = _compiled(config, layout, abstract, specs, mesh)
    print(f'| {layout} | {mib(here)} | {mib(unsplit)} | '
          f'{"-" if nbytes is None else mib(nbytes)} | {kinds or "-"} |',
          flush=True)
    rows.append({'config': label, 'mesh': mesh_name,
                 'num_params': model.num_params, 'layout': layout,
                 'bytes_per_device': here, 'bytes_undivided': unsplit,
                 'host_bytes_per_device': host,
                 'compiled_argument_bytes': nbytes,
                 'cross_worker_kinds': kinds})
  return rows, model.num_params


def main(argv):
  del argv
  _runs.setup(_CPU_DEVICES.value)
  import importlib  # pylint: disable=g-import-not-at-top
  if _CONFIG.value is not None:
    configs = [('config', _CONFIG.value)]
  else:
    configs = [(label, importlib.import_module(f'configs.{module}')
                .get_config(*(() if arg is None else (arg,))))
               for label, module, arg in PRESETS]
  rows = []
  for label, config in configs:
    rows += _measure(config, label)[0]
  if _WORKDIR.value:
    from experiments import tables  # pylint: disable=g-import-not-at-top
    results = {'compiled': _COMPILE.value, 'rows': rows}
    _runs.write(_WORKDIR.value, 'outer_state_memory',
                tables.render('outer_state_memory', 'main',
                              {'results': results}), results,
                configs={label: json.loads(json.dumps(c.to_dict(),
                                                      default=str))
                         for label, c in configs})


if __name__ == '__main__':
  app.run(main)
