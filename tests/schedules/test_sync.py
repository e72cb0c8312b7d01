"""Sync-period schedules, and QSR driving loc_opt.diloco."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import loc_opt
from loc_opt import schedules

STEPS = 160


def at(schedule, steps):
  out = np.asarray(jax.jit(schedule)(jnp.asarray(steps, jnp.int32)))
  assert out.dtype == np.int32
  return out


def test_qsr_worked_example():
  # Spec §12: alpha 0.0175, H_base 4.
  for lr, h in [(0.008, 4), (0.004, 19), (0.001, 306)]:
    sched = schedules.qsr_sync_schedule(4, 0.0175,
                                        optax.constant_schedule(lr))
    assert at(sched, [0, 1000]).tolist() == [h, h]


def test_qsr_rule_warmup_cap_and_zero_rate():
  lr = schedules.linear_decay_schedule(0.1, 100, warmup_steps=10)
  h = schedules.qsr_sync_schedule(2, 0.3, lr, warmup_steps=10,
                                  max_period=40)
  v = at(h, np.arange(101))
  rates = np.asarray(jax.jit(lr)(jnp.arange(101)))
  expect = np.clip(np.floor((0.3 / rates[10:100]) ** 2), 2, 40)
  np.testing.assert_array_equal(v[10:100], expect)
  assert np.all(v[:10] == 2)  # warmup: H_base even where lr is small
  assert v[100] == 40  # lr = 0: the cap
  assert np.all(np.diff(v[10:]) >= 0)  # decaying rate, growing period
  uncapped = schedules.qsr_sync_schedule(2, 0.3, lr)
  assert at(uncapped, [100])[0] == 2**30


def test_qsr_alpha_zero_is_constant():
  lr = schedules.warmup_cosine_schedule(1.0, 100, warmup_steps=5)
  h = schedules.qsr_sync_schedule(6, 0.0, lr)
  np.testing.assert_array_equal(at(h, np.arange(-1, 120)), 6)
  np.testing.assert_array_equal(
      at(h, np.arange(50)), at(schedules.constant_sync_schedule(6),
                               np.arange(50)))


def expected_syncs(periods):
  """Sync counts under diloco's rule: sync when steps_since_sync + 1 >= H."""
  syncs, since = [], 0
  for count, h in enumerate(periods):
    if since + 1 >= h:
      syncs.append(count)
      since = 0
    else:
      since += 1
  return syncs


def reference_rounds(rule_values, total):
  """QSR rounds as in the reference: H read at a round's start, frozen,
  capped at the steps left."""
  syncs, t = [], 0
  while t < total:
    h = min(int(rule_values[t]), total - t)
    t += h
    syncs.append(t - 1)
  return syncs


def run_diloco(sync_every):
  """Runs diloco with sgd on a fixed gradient stream; returns the counts
  that synced and the number of traces of the jitted step."""
  lr = schedules.warmup_cosine_schedule(0.1, STEPS, warmup_steps=10)
  tx = loc_opt.diloco(optax.sgd(lr), sync_every=sync_every, axis_name=None,
                      outer=optax.sgd(1.0))
  traces = []

  @jax.jit
  def step(params, state, grad):
    traces.append(None)
    updates, state = tx.update(grad, state, params)
    return optax.apply_updates(params, updates), state

  grads = jax.random.normal(jax.random.key(0), (STEPS, 3))
  params = jnp.zeros(3)
  state = tx.init(params)
  num_syncs = []
  for i in range(STEPS):
    params, state = step(params, state, grads[i])
    num_syncs.append(state.num_syncs)
  num_syncs = np.asarray(num_syncs)
  synced = np.flatnonzero(np.diff(np.concatenate([[0], num_syncs])))
  return synced.tolist(), len(traces), step._cache_size()


@pytest.mark.parametrize('frozen', [False, True])
def test_qsr_drives_diloco_without_recompiling(frozen):
  lr = schedules.warmup_cosine_schedule(0.1, STEPS, warmup_steps=10)
  kw = dict(max_period=32, warmup_steps=10)
  h = schedules.qsr_sync_schedule(2, 0.15, lr, total_steps=STEPS if frozen
                                  else None, **kw)
  periods = at(h, np.arange(STEPS))
  assert periods.min() == 2 and periods.max() > 10  # H really varies
  synced, traces, compiles = run_diloco(h)
  assert traces == 1 and compiles == 1
  assert synced == expected_syncs(periods)
  if frozen:
    rule = schedules.qsr_sync_schedule(2, 0.15, lr, **kw)
    assert synced == reference_rounds(at(rule, np.arange(STEPS)), STEPS)
    assert synced[-1] == STEPS - 1  # the last round ends with the run


def test_step_sync_schedule():
  counts = [-1, 0, 49, 50, 99, 100, 10**6]
  expect = [4, 4, 4, 8, 8, 16, 16]
  h = schedules.step_sync_schedule({'0': 4, '50': 8, '100': 16})
  np.testing.assert_array_equal(at(h, counts), expect)
  h2 = schedules.step_sync_schedule([(100, 16), (0, 4), (50, 8)])
  np.testing.assert_array_equal(at(h2, counts), expect)
  with pytest.raises(ValueError, match='start at count 0'):
    schedules.step_sync_schedule({10: 4})
  with pytest.raises(ValueError, match='period must be >= 1'):
    schedules.step_sync_schedule({0: 0})


def test_registry():
  lr = optax.constant_schedule(0.004)
  h = schedules.make_sync_schedule('qsr', base_period=4, alpha=0.0175,
                                   lr_schedule=lr)
  assert at(h, [0])[0] == 19
  assert at(schedules.make_sync_schedule('constant', period=7), [3])[0] == 7
  assert set(schedules.SYNC_SCHEDULES) == {'constant', 'step', 'qsr'}
  with pytest.raises(ValueError, match=r"unknown sync schedule 'nope' "
                     r'\(field outer.sync_schedule\)'):
    schedules.make_sync_schedule('nope')
  with pytest.raises(ValueError, match='outer.sync_schedule'):
    schedules.make_sync_schedule('constant', period=4, alpha=1.0)
  with pytest.raises(ValueError, match='outer.sync_schedule'):
    schedules.make_sync_schedule('qsr', base_period=4, alpha=0.1)
  with pytest.raises(ValueError, match='alpha must be >= 0'):
    schedules.make_sync_schedule('qsr', base_period=4, alpha=-1.0,
                                 lr_schedule=lr)
