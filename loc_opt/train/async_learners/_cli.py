"""The command lines of ``python -m loc_opt.train.async_learners.syncer``
and ``... .learner`` (absl flags; ``--config`` as the trainer's)."""

import dataclasses
import sys

from absl import app
from absl import flags
from ml_collections import config_flags


def _config_and_store():
  config = config_flags.DEFINE_config_file(
      'config', None, 'Trainer config file, e.g. configs/diloco_lm.py:mlp.')
  store = flags.DEFINE_string(
      'store', None, 'The store: a shared directory, or gs://... / s3://...')
  flags.mark_flags_as_required(['config', 'store'])
  return config, store


def run_syncer(main_fn, options_cls) -> None:
  """``python -m loc_opt.train.async_learners.syncer``: ``main_fn`` and
  ``options_cls`` are that module's ``main`` and ``SyncerOptions``."""
  config, store = _config_and_store()
  fields = {}
  for f in dataclasses.fields(options_cls):
    define = {int: flags.DEFINE_integer, float: flags.DEFINE_float,
              str: flags.DEFINE_string}[type(f.default)]
    fields[f.name] = define(f.name, f.default, f'SyncerOptions.{f.name}.')
  max_versions = flags.DEFINE_integer(
      'max_versions', None, 'Stop once this global version is published.')
  max_seconds = flags.DEFINE_float('max_seconds', None,
                                   'Stop after this many seconds.')
  log = flags.DEFINE_string('log', None, 'JSON-lines event log (stdout).')

  def main(argv):
    del argv
    import jax  # pylint: disable=g-import-not-at-top
    jax.config.update('jax_platforms', 'cpu')  # host-only
    options = options_cls(**{k: v.value for k, v in fields.items()})
    main_fn(config.value, store.value, options,
                max_versions=max_versions.value,
                max_seconds=max_seconds.value, log_path=log.value)

  app.run(main)


def run_learner(main_fn, rejoin_states) -> None:
  """``python -m loc_opt.train.async_learners.learner``: ``main_fn`` and
  ``rejoin_states`` are that module's ``main`` and ``REJOIN_STATES``."""
  config, store = _config_and_store()
  name = flags.DEFINE_string('learner', None, 'This learner\'s id.')
  index = flags.DEFINE_integer('index', 0, 'Its data shard.')
  num = flags.DEFINE_integer('num_learners', 1, 'Data shards.')
  codec = flags.DEFINE_string('codec', None, 'Payload codec (e.g. int8).')
  rejoin = flags.DEFINE_enum('rejoin_state', 'keep', list(
      rejoin_states), 'Inner state on a restart.')
  slow = flags.DEFINE_float('slowdown_s', 0., 'Sleep after each step.')
  rounds = flags.DEFINE_integer('max_rounds', None, 'Stop after N rounds.')
  stop = flags.DEFINE_integer('stop_at_version', None,
                              'Stop once this global version exists.')
  frags = flags.DEFINE_integer(
      'num_fragments', 1, 'Fragments of the model (the syncer\'s value): '
      'one fragment published every sync_every / num_fragments steps.')
  alpha = flags.DEFINE_float(
      'alpha', 0., 'Weight of the own copy when a merged fragment arrives '
      '(0: overwrite).')
  liveness = flags.DEFINE_float(
      'peer_liveness_s', 60., 'With --rejoin_state=peer: a peer is live if '
      'its newest inner state is this recent.')
  layout = _process_flags()
  flags.mark_flag_as_required('learner')

  def main(argv):
    del argv
    if layout['local_processes'].value < 1:
      raise app.UsageError('--local_processes='
                           f'{layout["local_processes"].value} must be >= 1')
    if layout['local_processes'].value > 1:
      sys.exit(_run_locally(layout['local_processes'].value))
    _join(layout)
    main_fn(config.value, store.value, name.value, index=index.value,
            num_learners=num.value, codec=codec.value,
            rejoin_state=rejoin.value, slowdown_s=slow.value,
            peer_liveness_s=liveness.value, num_fragments=frags.value,
            alpha=alpha.value,
            max_rounds=rounds.value, stop_at_version=stop.value)

  app.run(main)


def _process_flags() -> dict[str, flags.FlagHolder]:
  """A learner's process layout: the flags of ``loc-opt-train``
  (``docs/multihost.md``)."""
  return {
      'local_processes': flags.DEFINE_integer(
          'local_processes', 1, 'Run the learner as this many processes on '
          'this machine, joined by jax.distributed on a free localhost port '
          '(loc_opt.train.local_launch); the CPU only.'),
      'coordinator_address': flags.DEFINE_string(
          'coordinator_address', None,
          'host:port of the learner\'s process 0 (jax.distributed).'),
      'num_processes': flags.DEFINE_integer(
          'num_processes', None, 'Processes of this learner.'),
      'process_id': flags.DEFINE_integer(
          'process_id', None, 'This process: 0 .. num_processes - 1.'),
      'distributed': flags.DEFINE_bool(
          'distributed', False, 'Join with jax.distributed.initialize() '
          'without the layout flags (JAX detects TPU VM, SLURM, Open MPI).'),
  }


def _run_locally(num_processes: int) -> int:
  """This command as ``num_processes`` local processes of one learner."""
  from loc_opt.train import local_launch  # pylint: disable=g-import-not-at-top
  given = [f'--{k}' for k in ('coordinator_address', 'num_processes',
                              'process_id') if flags.FLAGS[k].present]
  if given:
    raise app.UsageError('--local_processes sets the layout itself; drop '
                         + ', '.join(given))
  return local_launch.run(
      [sys.executable, '-m', 'loc_opt.train.async_learners.learner',
       *sys.argv[1:], '--local_processes=1'], num_processes)


def _join(layout: dict[str, flags.FlagHolder]) -> None:
  """``jax.distributed.initialize`` when the layout asks for it."""
  kwargs = {k: layout[k].value for k in ('coordinator_address',
                                         'num_processes', 'process_id')
            if layout[k].value is not None}
  if kwargs or layout['distributed'].value:
    import jax  # pylint: disable=g-import-not-at-top
    from loc_opt.train import local_launch  # pylint: disable=g-import-not-at-top
    local_launch.join(jax, **kwargs)
