"""The names users meet first: what the docs call ``loc_opt.X`` exists,
every transform and schedule is at the top level, and a worker-averaging
transform outside a map over workers says what to wrap."""

import importlib
import pathlib
import re
import types

import jax
import jax.numpy as jnp
import optax
import pytest

import loc_opt
from loc_opt import inner
from loc_opt import schedules

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = [ROOT / 'README.md', ROOT / 'ARCHITECTURE.md',
         *sorted((ROOT / 'docs').glob('*.md'))]
DOTTED = re.compile(r'\bloc_opt(?:\.[A-Za-z_]\w*)+')
# Helpers that stay in their family's submodule.
INNER_HELPERS = {'make_optimizer', 'spam_warmup_factor', 'stable_spam_kappa',
                 'muon_adamw_labels'}


def resolve(dotted: str):
  """The object ``dotted`` names, importing submodules on the way (as
  ``import loc_opt.train`` would); raises if any part is missing."""
  parts = dotted.split('.')
  obj = importlib.import_module(parts[0])
  for i, part in enumerate(parts[1:], start=2):
    if not hasattr(obj, part):
      try:
        importlib.import_module('.'.join(parts[:i]))
      except ModuleNotFoundError:
        pass  # not a submodule either: getattr says what is missing
    obj = getattr(obj, part)
  return obj


def test_every_name_the_docs_use_exists():
  missing = []
  for page in PAGES:
    for name in sorted(set(DOTTED.findall(page.read_text()))):
      try:
        resolve(name)
      except AttributeError:
        missing.append(f'{page.name}: {name}')
  assert not missing, missing


def test_resolve_fails_on_a_missing_name():
  with pytest.raises(AttributeError):
    resolve('loc_opt.no_such_transform')
  with pytest.raises(AttributeError):
    resolve('loc_opt.parallel.no_such_function')


def _public_functions(module: types.ModuleType) -> set[str]:
  return {n for n, v in vars(module).items()
          if not n.startswith('_') and isinstance(v, types.FunctionType)}


@pytest.mark.parametrize('names', [
    pytest.param(_public_functions(inner) - INNER_HELPERS, id='inner'),
    pytest.param({n for n in _public_functions(schedules)
                  if n.endswith('_schedule') and not n.startswith('make_')} | {
                      'wsds_branch', 'schedule_free_adamw',
                      'schedule_free_sgd', 'schedule_free_eval_params'},
                 id='schedules'),
    pytest.param({n for n in _public_functions(loc_opt.outer)
                  if n.endswith('_eval_params')}, id='eval_params'),
])
def test_transforms_and_schedules_are_top_level(names):
  assert names, 'nothing found to check'
  missing = sorted(n for n in names if not hasattr(loc_opt, n))
  assert not missing, missing
  for n in names:
    assert getattr(loc_opt, n) is resolve(f'loc_opt.{n}')


def test_every_trainer_method_is_top_level():
  from loc_opt.train import registry  # pylint: disable=g-import-not-at-top
  baselines = {'data_parallel', 'compressed_data_parallel'}
  missing = [m for m in registry.METHODS
             if m not in baselines and not hasattr(loc_opt, m)]
  assert not missing, missing


@pytest.mark.parametrize('make', [
    lambda: loc_opt.diloco(optax.sgd(0.1), sync_every=2),
    lambda: loc_opt.local_sgd(optax.sgd(0.1), sync_every=2),
    lambda: loc_opt.diloco(optax.sgd(0.1), sync_every=2, codec='int8'),
    lambda: loc_opt.noloco(optax.sgd(0.1), sync_every=2),
    lambda: loc_opt.streaming_diloco(optax.sgd(0.1), sync_every=2,
                                     num_fragments=1),
], ids=['diloco', 'local_sgd', 'diloco_int8', 'noloco', 'streaming'])
def test_unbound_worker_axis_says_what_to_wrap(make):
  tx = make()
  params = {'w': jnp.ones((4, 3))}
  with pytest.raises(NameError) as err:
    jax.jit(tx.update)(params, tx.init(params), params)
  message = str(err.value)
  for hint in ("'worker'", 'vmap_workers', 'shard_map_workers',
               'axis_name=None', 'docs/quickstart.md'):
    assert hint in message, (hint, message)


def test_the_same_update_runs_under_vmap_workers():
  tx = loc_opt.diloco(optax.sgd(0.1), sync_every=1)
  params = loc_opt.parallel.replicate({'w': jnp.ones(3)}, 2)
  grads = {'w': jnp.stack([jnp.ones(3), -jnp.ones(3)])}
  step = jax.jit(loc_opt.parallel.vmap_workers(tx.update))
  updates, _ = step(grads, jax.vmap(tx.init)(params), params)
  # Opposite gradients average to zero at the sync: no movement.
  assert jnp.allclose(updates['w'], 0.0)


def test_replicate_stacks_copies_and_checks_the_count():
  out = loc_opt.parallel.replicate({'w': jnp.arange(3.0)}, 2)
  assert out['w'].shape == (2, 3)
  assert jnp.array_equal(out['w'][1], jnp.arange(3.0))
  with pytest.raises(ValueError, match='num_workers'):
    loc_opt.parallel.replicate({'w': jnp.ones(3)}, 0)
