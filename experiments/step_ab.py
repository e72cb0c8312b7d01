r"""Step time of config variants, timed in alternating blocks in one process.

On a machine whose speed drifts (this repository's 2-core VM drifts by
10-20% over minutes), runs in separate processes minutes apart do not
compare. This program compiles the launcher's inner step
(``loc_opt.train`` programs, as ``experiments.train`` runs them) for each
variant of one config, on the same devices, and times the variants in
alternating blocks of ``--block`` steps, ``--rounds`` times, so that drift
hits all of them alike. Each step is timed alone (``block_until_ready``);
the figure is the median, and tokens/s counts ``batch_size * seq_len`` per
step.

A variant is ``NAME=FIELD=VALUE,FIELD=VALUE`` (dotted config fields; a
value is read as a Python literal where it is one, else as a string), or
``NAME=`` for the config as given. The first variant is the reference of
the ratio column. E.g. the 853k LM's weight and attention gradients, the
workers stacked on one CPU device::

  python -m experiments.step_ab --config=configs/diloco_lm.py \
    --config.model.num_layers=4 --config.mesh.simulate_workers=True \
    --config.mesh.data=1 --cpu_devices=1 --variant='defaults=' \
    --variant='jax_rules=model.weight_grad=xla,model.backward=xla' \
    --workdir=/tmp/step_ab

XLA flags and device counts are process-wide: compare those with separate
runs (``experiments.benchmark_step_time``'s levers) instead.
"""

import ast
import statistics
from typing import Any

from absl import app
from absl import flags
from ml_collections import config_flags

from experiments import _runs
from experiments import _train_tables

_CONFIG = config_flags.DEFINE_config_file('config', 'configs/diloco_lm.py',
                                          'Config file.')
_VARIANTS = flags.DEFINE_multi_string(
    'variant', None, 'NAME=FIELD=VALUE,FIELD=VALUE (or NAME= for the config '
    'as given); two or more.')
_ROUNDS = flags.DEFINE_integer('rounds', 6, 'Rounds of alternating blocks.')
_BLOCK = flags.DEFINE_integer('block', 5, 'Steps per block.')
_WARMUP = flags.DEFINE_integer('warmup', 2, 'Untimed steps per variant.')
_CPU_DEVICES = flags.DEFINE_integer('cpu_devices', 8, 'Virtual CPU devices.')
_WORKDIR = flags.DEFINE_string(
    'workdir', '/tmp/step_ab', 'Write the results file <results_name>.json '
    'here.')
# The results names experiments.regenerate writes with this program (its
# arguments are there), each published in docs/benchmarks.md.
REGENERATED = ('step_ab_853k', 'step_ab_1480k')
_RESULTS_NAME = flags.DEFINE_string(
    'results_name', 'step_ab', 'Name of the results file (regenerate: one '
    f'of {list(REGENERATED)}).')


def _value(text: str) -> Any:
  try:
    return ast.literal_eval(text)
  except (ValueError, SyntaxError):
    return text


def parse_variant(spec: str) -> tuple[str, dict[str, Any]]:
  """``'name=a.b=1,c=x'`` -> ``('name', {'a.b': 1, 'c': 'x'})``."""
  name, sep, rest = spec.partition('=')
  if not sep or not name:
    raise ValueError(f'--variant {spec!r}: expected NAME=FIELD=VALUE,... or '
                     'NAME=')
  overrides = {}
  for item in filter(None, rest.split(',')):
    field, sep, value = item.partition('=')
    if not sep or not field:
      raise ValueError(f'--variant {spec!r}: {item!r} is not FIELD=VALUE')
    overrides[field] = _value(value)
  return name, overrides


def time_variants(config, variants: dict[str, dict[str, Any]], rounds: int,
                  block: int, warmup: int) -> dict[str, dict[str, Any]]:
  """Median step time and tokens/s of each variant's compiled inner step,
  timed in alternating blocks."""
  from loc_opt.train import config as cfg_lib  # pylint: disable=g-import-not-at-top

  configs = {}
  for name, overrides in variants.items():  # every variant before a compile
    try:
      configs[name] = cfg_lib.with_overrides(config, overrides)
    except KeyError as e:
      raise ValueError(f'variant {name!r}: {e.args[0]}') from e
  programs = {name: _runs.inner_step(c)[1] for name, c in configs.items()}
  tokens = {name: c.batch_size * c.data.seq_len
            for name, c in configs.items()}
  times = _runs.time_alternating(programs, rounds, block, warmup)
  out = {}
  for name, ts in times.items():
    med = statistics.median(ts)
    out[name] = {'overrides': variants[name], 'median_step_s': med,
                 'tokens_per_s': tokens[name] / med, 'steps_timed': len(ts)}
  return out


def main(argv):
  del argv
  specs = _VARIANTS.value or []
  if len(specs) < 2:
    raise app.UsageError('give two or more --variant')
  for flag in ('rounds', 'block'):
    if flags.FLAGS[flag].value < 1:
      raise app.UsageError(f'--{flag} must be >= 1')
  variants = dict(parse_variant(s) for s in specs)
  if len(variants) != len(specs):
    raise app.UsageError('variant names must differ')
  _runs.setup(_CPU_DEVICES.value)
  config = _CONFIG.value
  results = {
      'variants': time_variants(config, variants, _ROUNDS.value,
                                _BLOCK.value, _WARMUP.value),
      'rounds': _ROUNDS.value, 'block': _BLOCK.value,
      'model': config.model.name,
      'model_sizes': {k: config.model.get(k) for k in ('num_layers',
                                                       'd_model')},
      'mesh': config.mesh.to_dict(),
      'cpu_devices': _CPU_DEVICES.value}
  _runs.write(_WORKDIR.value, _RESULTS_NAME.value,
              _train_tables.step_ab_main({'results': results}), results)


if __name__ == '__main__':
  app.run(main)
