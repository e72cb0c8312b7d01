"""The runs of the bytes-at-quality frontier (``experiments/frontier.py``):
each run's method, label, field overrides and key knob, and the config of a
run at one knob value. Kept apart from the program so that tests import it
without the program's flags."""

from experiments import _runs


_FP4 = {'outer__codec': 'fp4_e3m0', 'outer__codec_kwargs': {
    'block_size': None}}


def _diloco(h, codec=None):
  fields = {'outer__method': 'diloco', 'outer__sync_every': h}
  fields.update(codec or {})
  return fields


# name -> (family, label, overrides ('__' for '.'), (knob field, values:
# the default first)). Family: the point's method in the figure.
RUNS = {
    'dp': ('data-parallel', 'data-parallel, fp32',
           {'outer__method': 'data_parallel'}, None),
    'diloco_h30_fp32': ('DiLoCo', 'DiLoCo H=30, fp32', _diloco(30),
                        ('outer__learning_rate', (0.7, 0.4))),
    'diloco_h100_fp32': ('DiLoCo', 'DiLoCo H=100, fp32', _diloco(100),
                         ('outer__learning_rate', (0.7, 0.4))),
    'diloco_h300_fp32': ('DiLoCo', 'DiLoCo H=300, fp32', _diloco(300),
                         ('outer__learning_rate', (0.7, 0.4))),
    'diloco_h100_fp4': ('DiLoCo', 'DiLoCo H=100, fp4', _diloco(100, _FP4),
                        ('outer__learning_rate', (0.7, 0.4))),
    'diloco_h300_2bit': ('DiLoCo', 'DiLoCo H=300, 2-bit',
                         _diloco(300, {'outer__codec': 'two_bit'}),
                         ('outer__learning_rate', (0.7, 0.4))),
    'streaming_h100_fp4': ('Streaming DiLoCo',
                           'Streaming DiLoCo H=100, P=3, tau=1, fp4',
                           {'outer__method': 'streaming_diloco',
                            'outer__sync_every': 100, **_FP4},
                           ('outer__learning_rate', (0.7, 0.4))),
    'sparseloco_h30': ('SparseLoCo', 'SparseLoCo H=30 (top-128 per 64x64)',
                       {'outer__method': 'sparseloco',
                        'outer__sync_every': 30},
                       ('outer__sparseloco__topk', (128, 32))),
    'muloco2bit_h30': ('DiLoCo + MuLoCo codec',
                       'DiLoCo H=30, 2-bit statistical + EF 0.9',
                       _diloco(30, {'outer__codec': 'statistical',
                                    'outer__codec_kwargs': {'bits': 2},
                                    'outer__error_feedback': 'ef',
                                    'outer__ef_decay': 0.9}),
                       ('outer__learning_rate', (0.7, 0.4))),
    'noloco_h30': ('NoLoCo', 'NoLoCo H=30', {'outer__method': 'noloco',
                                             'outer__sync_every': 30},
                   ('outer__learning_rate', (0.7, 0.4))),
    'demo': ('DeMo', 'DeMo (every step, top-32 of 64x64 DCT)',
             {'outer__method': 'demo'}, ('outer__demo__topk', (32, 8))),
    'diloco_h30_int8': ('DiLoCo', 'DiLoCo H=30, int8',
                        _diloco(30, {'outer__codec': 'int8'}),
                        ('outer__learning_rate', (0.7, 0.4))),
    'diloco_h30_fp4': ('DiLoCo', 'DiLoCo H=30, fp4', _diloco(30, _FP4),
                       ('outer__learning_rate', (0.7, 0.4))),
    'diloco_h30_2bit': ('DiLoCo', 'DiLoCo H=30, 2-bit',
                        _diloco(30, {'outer__codec': 'two_bit'}),
                        ('outer__learning_rate', (0.7, 0.4))),
    'diloco_h100_int8': ('DiLoCo', 'DiLoCo H=100, int8',
                         _diloco(100, {'outer__codec': 'int8'}),
                         ('outer__learning_rate', (0.7, 0.4))),
    'diloco_h100_2bit': ('DiLoCo', 'DiLoCo H=100, 2-bit',
                         _diloco(100, {'outer__codec': 'two_bit'}),
                         ('outer__learning_rate', (0.7, 0.4))),
    'diloco_h300_int8': ('DiLoCo', 'DiLoCo H=300, int8',
                         _diloco(300, {'outer__codec': 'int8'}),
                         ('outer__learning_rate', (0.7, 0.4))),
    'diloco_h300_fp4': ('DiLoCo', 'DiLoCo H=300, fp4', _diloco(300, _FP4),
                        ('outer__learning_rate', (0.7, 0.4))),
}


def knob_values(name: str, outer_lrs=None) -> tuple:
  """Run ``name``'s knob values, the default first; ``outer_lrs`` replaces
  those of every run whose knob is the outer learning rate."""
  knob = RUNS[name][3]
  if knob is None:
    return (None,)
  if outer_lrs and knob[0] == 'outer__learning_rate':
    return tuple(outer_lrs)
  return knob[1]


def points(names, tune: bool, outer_lrs=None) -> list[tuple[str, object]]:
  """``(run, knob value)`` in the order they run: each run at its default,
  then (``tune``) each run's other values."""
  out = [(n, knob_values(n, outer_lrs)[0]) for n in names]
  if tune:
    out += [(n, v) for n in names for v in knob_values(n, outer_lrs)[1:]]
  return out


def run_dir_name(name: str, value, outer_lrs=None) -> str:
  """The run directory: the run's name, with the knob value where it is
  not the default."""
  default = knob_values(name, outer_lrs)[0]
  return name if default is None or value == default else f'{name}_{value:g}'


def config_of(base, name: str, value, *, num_steps: int, dp_lr: float,
              inner_lr: float, devices: int):
  """The config of run ``name`` at knob ``value``: M = 4 workers over
  ``devices`` devices, ``num_steps`` steps, the base config's model."""
  _, _, overrides, knob = RUNS[name]
  fields = {'num_steps': num_steps, 'mesh__workers': 4,
            'mesh__data': devices // 4, 'mesh__fsdp': 1, 'mesh__tensor': 1,
            'eval_every': max(num_steps // 6, 1),
            'checkpoint_every': max(num_steps // 6, 1),
            'optimizer__learning_rate': (
                dp_lr if overrides['outer__method'] == 'data_parallel'
                else inner_lr)}
  fields.update(overrides)
  if knob is not None:
    fields[knob[0]] = value
  return _runs.variant(base, **fields)
