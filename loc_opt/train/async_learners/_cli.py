"""The command lines of ``python -m loc_opt.train.async_learners.syncer``
and ``... .learner`` (absl flags; ``--config`` as the trainer's)."""

import dataclasses

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
  flags.mark_flag_as_required('learner')

  def main(argv):
    del argv
    main_fn(config.value, store.value, name.value, index=index.value,
                 num_learners=num.value, codec=codec.value,
                 rejoin_state=rejoin.value, slowdown_s=slow.value,
                 max_rounds=rounds.value, stop_at_version=stop.value)

  app.run(main)
