"""Every method runs from its name alone: ``--config.outer.method=NAME`` on
the default config and on ``:mlp`` validates, builds its transform and
initialises its state (abstractly: no compile), with no second setting."""

import functools

import jax
import pytest

from configs import diloco_lm
from loc_opt import models
from loc_opt import parallel
from loc_opt.train import config as cfg_lib
from loc_opt.train import experiment
from loc_opt.train import registry
from loc_opt.train import state as state_lib


@pytest.mark.parametrize('model', [None, 'mlp'])
@pytest.mark.parametrize('name', sorted(registry.METHODS))
def test_every_method_runs_from_its_name(name, model):
  config = diloco_lm.get_config(model)
  config.outer.method = name
  experiment.validate_config(config, 8)
  method = registry.get_method(name)
  tx = method.build(config, cfg_lib.make_inner(config),
                    parallel.WORKER)
  init = functools.partial(state_lib.init_state,
                           model=models.build_model(config.model), tx=tx,
                           method=method, workers=config.mesh.workers)
  state = jax.eval_shape(init, jax.random.key(0))
  assert jax.tree.leaves(state['opt_state']) or name == 'data_parallel'


def test_defaults_that_fit_the_shared_ones():
  config = diloco_lm.get_config('mlp')
  # Streaming DiLoCo: P = 0 picks the first of 3, 2, 1 dividing H.
  config.outer.method = 'streaming_diloco'
  for h, p in ((30, 3), (50, 2), (49, 1)):
    config.outer.sync_every = h
    assert cfg_lib.streaming_fragments(0, h) == p
    experiment.validate_config(config, 8)
  assert cfg_lib.streaming_fragments(5, 50) == 5
  # MT-DAO on the default 'adamw' builds multi_timescale_adam; another
  # optimizer is named in the error.
  config.outer.method = 'mt_dao'
  config.outer.sync_every = 50
  assert cfg_lib.mt_dao_optimizer(config) == (
      'multi_timescale_adam', {'b2': 0.95, 'weight_decay': 0.1})
  config.optimizer.name = 'sgd'
  with pytest.raises(ValueError, match="needs optimizer.name="
                     "'multi_timescale_adam' .or 'adamw'.*got 'sgd'"):
    experiment.validate_config(config, 8)
