r"""Size on disk of the reference run's checkpoint, and what takes it.

Trains the config (default ``configs/diloco_lm.py``: DiLoCo, 4 workers x 2
data-parallel devices, AdamW inner, Nesterov outer) for ``--num_steps``
steps, a checkpoint every 30, and measures its newest checkpoint step
directory ``checkpoints/<step>/``:

* its bytes: the sum of the sizes of the files under it (what ``du -sb``
  prints), and the bytes under each of its entries (the items ``state``,
  ``layout`` and ``config``, Orbax's step files) and under each entry of
  ``state`` (the OCDBT store of this process, ``ocdbt.process_0/``, which
  holds the arrays; the root OCDBT manifest and index; Orbax's metadata);
* the stored bytes of each part of the saved state tree (``shared`` and
  ``per_worker``, ``loc_opt.train.layout``): the sum of the values under
  its keys in the ``state`` item's OCDBT key-value store (zstd-compressed
  zarr chunks and their ``.zarray``), read with tensorstore, and the raw
  bytes of its arrays (shape x item size, from each ``.zarray``);
* computed from shapes, not measured: the raw bytes the shared anchor and
  outer optimizer state would add if every worker's copy were stored,
  ``(M - 1)`` x their raw bytes (``parameters x 4 B x 2 x (M - 1)`` for an
  fp32 model under Nesterov).

  python -m experiments.checkpoint_size --workdir=DIR

Writes ``checkpoint_size.md`` and the results file ``checkpoint_size.json``
to --workdir; the run is in ``DIR/run`` and is read back when finished.
A few minutes on 2 CPU cores.
"""

import copy
import json
import math
import os
import pathlib

from absl import app, flags
from ml_collections import config_flags

from experiments import _runs

_CONFIG = config_flags.DEFINE_config_file('config', 'configs/diloco_lm.py',
                                          'Config file.')
_WORKDIR = flags.DEFINE_string('workdir', None, 'Where results go.')
_CPU_DEVICES = flags.DEFINE_integer('cpu_devices', 8, 'Virtual CPU devices.')
_NUM_STEPS = flags.DEFINE_integer('num_steps', 60, 'Steps of the run.')
flags.mark_flag_as_required('workdir')

CHECKPOINT_EVERY = 30


def _bytes_under(path: pathlib.Path, dirs: bool = False) -> int:
  """The sum of the sizes of the files under ``path`` (or of ``path``, a
  file); with ``dirs``, of the directories' entries too, as ``du -sb``
  counts them."""
  if path.is_file():
    return path.stat().st_size
  return sum(p.stat().st_size for p in [path, *path.rglob('*')]
             if p.is_file() or (dirs and p.is_dir()))


def _group(key: str) -> str:
  """The part of the saved tree a key of the OCDBT store belongs to:
  ``'shared/opt_state/anchor'`` for ``'shared.opt_state.anchor.x/0'``."""
  parts = key.split('/')[0].split('.')
  depth = 3 if len(parts) > 2 and parts[1] == 'opt_state' else 2
  return '/'.join(parts[:depth])


def _stored(state_dir: pathlib.Path) -> dict[str, dict[str, int]]:
  """Per part of the saved tree (:func:`_group`): the bytes of its values
  in the OCDBT store (compressed chunks and metadata), the raw bytes of
  its arrays and their count, in the order of the keys."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  import tensorstore as ts  # pylint: disable=g-import-not-at-top
  kv = ts.KvStore.open({'driver': 'ocdbt',
                        'base': f'file://{state_dir.absolute()}'}).result()
  out: dict[str, dict[str, int]] = {}
  for raw in kv.list().result():
    key = raw.decode()
    value = kv.read(raw).result().value
    part = out.setdefault(_group(key), {'stored_bytes': 0, 'raw_bytes': 0,
                                        'arrays': 0})
    part['stored_bytes'] += len(value)
    if key.endswith('/.zarray'):
      meta = json.loads(bytes(value))
      part['raw_bytes'] += (math.prod(meta['shape'])
                            * np.dtype(meta['dtype']).itemsize)
      part['arrays'] += 1
  return out


def _measure(step_dir: pathlib.Path) -> dict:
  """Bytes of the checkpoint step directory, per entry and per part of the
  saved state."""
  entries = {p.name: _bytes_under(p) for p in sorted(step_dir.iterdir())}
  state = step_dir / 'state'
  layout = step_dir / 'layout' / 'metadata'
  return {
      'step': int(step_dir.name),
      'total_bytes': _bytes_under(step_dir),
      'du_sb_bytes': _bytes_under(step_dir, dirs=True),
      'entries': entries,
      'state_entries': {p.name: _bytes_under(p)
                        for p in sorted(state.iterdir())},
      'parts': _stored(state),
      'layout': (json.loads(layout.read_text()) if layout.exists()
                 else None)}


def main(argv):
  del argv
  _runs.setup(_CPU_DEVICES.value)
  from experiments import tables  # pylint: disable=g-import-not-at-top
  from loc_opt import models  # pylint: disable=g-import-not-at-top
  config = copy.deepcopy(_CONFIG.value)
  config.num_steps = _NUM_STEPS.value
  config.checkpoint_every = CHECKPOINT_EVERY
  config.progress = False
  run_dir = os.path.join(_WORKDIR.value, 'run')
  summary = _runs.run(config, run_dir, 'reference DiLoCo LM')
  ckpts = pathlib.Path(run_dir) / 'checkpoints'
  newest = max((p for p in ckpts.iterdir() if p.name.isdigit()),
               key=lambda p: int(p.name))
  measured = _measure(newest)
  workers = config.mesh.workers
  shared = ('shared/opt_state/anchor', 'shared/opt_state/outer_state')
  shared_raw = sum(measured['parts'].get(k, {}).get('raw_bytes', 0)
                   for k in shared)
  num_params = models.build_model(config.model).num_params
  results = {
      'setup': {'config': 'configs/diloco_lm.py', 'num_params': num_params,
                'workers': workers, 'inner': config.optimizer.name,
                'outer': ('Nesterov' if config.outer.nesterov
                          else 'heavy-ball'),
                'outer_learning_rate': config.outer.learning_rate,
                'outer_momentum': config.outer.momentum,
                'method': config.outer.method,
                'num_steps': config.num_steps,
                'checkpoint_every': config.checkpoint_every,
                'final_eval_loss': summary['final_eval_loss']},
      **measured,
      'computed': {
          'shared_fields': list(shared),
          'shared_raw_bytes': shared_raw,
          'extra_copies': workers - 1,
          'extra_raw_bytes_if_per_worker': shared_raw * (workers - 1)}}
  print(json.dumps(results, indent=1), flush=True)
  _runs.write(_WORKDIR.value, 'checkpoint_size',
              tables.render('checkpoint_size', 'main',
                            {'results': results}), results)


if __name__ == '__main__':
  app.run(main)
