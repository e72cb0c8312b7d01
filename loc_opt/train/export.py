"""A run's global model out of its workdir (``loc-opt-export``).

:func:`export_model` restores a checkpoint of a run and writes its global
model, as a plain parameter pytree that Orbax alone restores, with the
model config beside it::

  OUT/params/      an Orbax checkpoint of the parameter pytree
  OUT/model.json   the run's ``model`` config section
  OUT/export.json  where it came from: workdir, step, method, source

The global model is the method's evaluation weights: DiLoCo's (and every
anchored method's) anchor, the parameters of a data-parallel run; for a
method whose workers' evaluation weights differ (no shared anchor), their
average. Loading it into the reference model takes three lines::

  params = ocp.StandardCheckpointer().restore(f'{out}/params')
  model = loc_opt.models.build_model(json.load(open(f'{out}/model.json')))
  logits = model.apply(params, tokens)  # tokens: int [batch, length]

A user's own Flax module takes ``params`` as its variables in the same way
(``module.apply({'params': params}, x)`` for Linen, ``nnx.update`` for NNX)
when it has the parameter tree the run was trained with.
"""

import json
import os
import pathlib
from typing import Any

import jax
import ml_collections
import numpy as np
import orbax.checkpoint as ocp

from loc_opt.train import checkpoint as ckpt_lib
from loc_opt.train import config as cfg_lib
from loc_opt.train import experiment as exp_lib
from loc_opt.train import hosts


def saved_config(workdir: str | os.PathLike, step: int
                 ) -> ml_collections.ConfigDict:
  """The config checkpoint ``step`` of ``workdir`` was written with."""
  ckpt = ckpt_lib.Checkpointer(workdir, every=0, read_only=True)
  try:
    saved = ckpt.manager.restore(
        step, args=ocp.args.Composite(config=ocp.args.JsonRestore()))
  finally:
    ckpt.close()
  return ml_collections.ConfigDict(saved['config'])


def global_params(exp: exp_lib.Experiment, state: dict[str, Any]
                  ) -> tuple[Any, str]:
  """``(params, source)``: the run's global model as host arrays, and what
  it is (``'anchor'``, ``'parameters'`` or ``'average of the workers'``)."""
  params = jax.tree.map(hosts.fetch, exp.eval_params(state))
  if not exp.method.per_worker:
    return params, 'parameters'
  leaves = jax.tree.leaves(params)
  same = all(np.array_equal(x, x[:1].repeat(x.shape[0], 0)) for x in leaves)
  if same:
    source = ('anchor' if exp.method.eval_params is not None
              else 'parameters (equal on every worker)')
    return jax.tree.map(lambda x: x[0], params), source
  return (jax.tree.map(lambda x: x.mean(0).astype(x.dtype), params),
          'average of the workers')


def export_model(workdir: str | os.PathLike, out_dir: str | os.PathLike,
                 *, step: int | None = None) -> dict[str, Any]:
  """Writes the global model of ``workdir``'s checkpoint ``step`` (default:
  the latest) to ``out_dir`` (see the module docstring).

  Returns:
    What ``OUT/export.json`` holds, plus ``params_dir`` and
    ``model_config`` (the paths written).

  Raises:
    CheckpointError: if ``workdir`` has no (such) checkpoint.
    FileExistsError: if ``out_dir/params`` exists.
  """
  out = pathlib.Path(out_dir).absolute()
  if (out / 'params').exists():
    raise FileExistsError(f'{out / "params"} exists; export to a new --out')
  latest = ckpt_lib.latest_step(workdir)
  if latest is None:
    raise ckpt_lib.CheckpointError(f'no checkpoint in {workdir}')
  step = latest if step is None else step
  config = saved_config(workdir, step)
  exp = exp_lib.get_experiment(config)
  ckpt = ckpt_lib.Checkpointer(workdir, every=0, read_only=True,
                               layout=exp.layout)
  try:
    step, state = ckpt.restore(exp.layout, cfg_lib.config_to_json(config),
                               step)
  finally:
    ckpt.close()
  params, source = global_params(exp, state)
  info = {'workdir': str(pathlib.Path(workdir).absolute()), 'step': step,
          'method': config.outer.method, 'source': source}
  if hosts.is_writer():
    out.mkdir(parents=True, exist_ok=True)
    saver = ocp.StandardCheckpointer()
    saver.save(out / 'params', params)
    saver.wait_until_finished()
    saver.close()
    (out / 'model.json').write_text(
        json.dumps(config.model.to_dict(), indent=2))
    (out / 'export.json').write_text(json.dumps(info, indent=2))
  return dict(info, params_dir=str(out / 'params'),
              model_config=str(out / 'model.json'))
