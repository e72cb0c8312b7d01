"""Fragment payloads of the asynchronous learners (``num_fragments > 1``):
the split and schedule (:class:`wire.Fragments`), the syncer's merge per
fragment in-process, and a syncer with two learners as real processes."""

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import optax
import pytest

from loc_opt.outer import _fragments
from loc_opt.outer import decoupled_clock
from loc_opt.outer.decoupled_diloco import merge_stacked
from loc_opt.outer.decoupled_diloco import token_weight
from loc_opt.train.async_learners import store as store_lib
from loc_opt.train.async_learners import syncer as syncer_lib
from loc_opt.train.async_learners import wire


def _init(seed=0):
  rng = np.random.default_rng(seed)
  return {'a': rng.normal(size=(8, 6)).astype(np.float32),
          'b': rng.normal(size=(40,)).astype(np.float32),
          'c': rng.normal(size=(6, 7)).astype(np.float32),
          'd': rng.normal(size=(3,)).astype(np.float32)}


def _like(tree):
  return jax.tree.map(lambda x: np.zeros_like(x), tree)


# ------------------------------------------------------------ the split ---
def test_fragments_split_as_the_spmd_version_and_round_trip():
  init = _init()
  frags = wire.Fragments(init, 2)
  ids = jax.tree.leaves(_fragments.balanced_fragments(init, 2))
  assert [sorted(g) for g in frags.leaves] == [
      [i for i, f in enumerate(ids) if f == p] for p in range(2)]
  # the fragment trees are lists of their leaves; put puts them back
  zero = _like(init)
  for p in range(2):
    part = frags.take(init, p)
    assert [x.shape for x in part] == [x.shape for x in frags.like[p]]
    back = frags.put(zero, p, part)
    for i, (x, y) in enumerate(zip(jax.tree.leaves(back),
                                   jax.tree.leaves(init))):
      np.testing.assert_array_equal(x, y if i in frags.leaves[p] else 0.)
  one = wire.Fragments(init, 1)
  assert one.take(init, 0) is init and one.put(zero, 0, init) is init
  with pytest.raises(ValueError, match='num_fragments'):
    wire.Fragments(init, 0)
  with pytest.raises(ValueError, match='num_fragments=5'):
    wire.Fragments(init, 5)  # more fragments than leaves
  with pytest.raises(ValueError, match='num_fragments=3 must divide'):
    wire.Fragments(init, 3).stride(8)


def test_the_schedule_is_the_spmd_timelines():
  # decoupled_timeline opens fragment p's window after inner step t with
  # t mod H = p H / P; a learner publishes that fragment after step t
  h, p_count = 8, 4
  timeline = decoupled_clock.decoupled_timeline(
      40, num_learners=1, sync_every=h, num_fragments=p_count, quorum=1)
  opened = [(int(r.opened) + 1, r.fragment) for r in timeline.rounds]
  frags = wire.Fragments(_init(), p_count)
  assert opened and opened == [(t, frags.due(t, h)) for t, _ in opened]
  assert [f for _, f in opened[:5]] == [1, 2, 3, 0, 1]


# -------------------------------------------------- the merge, in-process ---
def _publish(store, learner, seq, delta, fragment, base, tokens=100.):
  store.publish_payload(learner, seq, delta, {
      'fragment': fragment, 'base_fragment_version': base,
      'base_version': 0, 'tokens': tokens, 'steps': 4., 'wall': 0.})


def _delta(frags, p, seed):
  rng = np.random.default_rng(seed)
  return [rng.normal(size=x.shape).astype(np.float32) for x in frags.like[p]]


def test_the_syncer_merges_each_fragment_on_its_own(tmp_path):
  init = _init()
  store = store_lib.Store(tmp_path)
  opts = syncer_lib.SyncerOptions(quorum=2, grace_cap_s=0., num_fragments=2,
                                  max_staleness=1)
  syncer = syncer_lib.Syncer(store, init, opts, init=init)
  frags = syncer.frags
  d00, d10, d01 = (_delta(frags, 0, 1), _delta(frags, 0, 2),
                   _delta(frags, 1, 3))
  _publish(store, 'l0', 0, d01, 1, 0)   # l0's fragment 1
  _publish(store, 'l0', 1, d00, 0, 0)   # l0's fragment 0
  _publish(store, 'l1', 0, d10, 0, 0, tokens=300.)  # l1's fragment 0
  syncer.poll()
  # fragment 0 has a quorum of 2 learners; fragment 1 only one
  assert syncer.due(time.time()) == 0 and syncer.ready(time.time())
  info = syncer.merge()
  assert info['fragment'] == 0
  assert sorted(map(tuple, info['payloads'])) == [('l0', 1), ('l1', 0)]
  # by hand: token weights, merge_stacked, Nesterov on fragment 0's leaves
  w = np.asarray(token_weight(np.array([100., 300.], np.float32),
                              np.full(2, 4., np.float32)))
  got_w = dict(zip(map(tuple, info['payloads']), info['weights']))
  np.testing.assert_allclose([got_w[('l0', 1)], got_w[('l1', 0)]], w)
  merged = merge_stacked([np.stack(x) for x in zip(d00, d10)], w,
                         direct=[False] * len(d00))
  tx = optax.sgd(0.7, momentum=0.9, nesterov=True)
  start = frags.take(init, 0)
  upd, _ = tx.update(merged, tx.init(start), start)
  want = optax.apply_updates(start, upd)
  for got, ref in zip(frags.take(syncer.params, 0), want):
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6)
  for got, ref in zip(frags.take(syncer.params, 1), frags.take(init, 1)):
    np.testing.assert_array_equal(got, ref)  # fragment 1 untouched
  # fragment 1's outer state (its momentum) is untouched too
  assert all(not np.any(x) for x in jax.tree.leaves(syncer.outer_state[1]))
  assert any(np.any(x) for x in jax.tree.leaves(syncer.outer_state[0]))
  c = syncer.counters
  assert c['fragment_versions'] == [1, 0] and syncer.version == 1
  # l0's fragment-0 payload (seq 1) is consumed, its older seq 0 waits
  assert c['consumed'] == {'l0': -1, 'l1': 0}
  assert c['consumed_above'] == {'l0': [1]}
  assert [(p.learner, p.seq) for p in syncer.pending] == [('l0', 0)]

  # a restarted syncer resumes from version 1: it reads l0's seq 0 again
  # (not merged yet) and never seq 1 (merged)
  store.close()
  store = store_lib.Store(tmp_path)
  syncer = syncer_lib.Syncer(store, init, opts)
  assert syncer.counters['fragment_versions'] == [1, 0]
  syncer.poll()
  assert [(p.learner, p.seq) for p in syncer.pending] == [('l0', 0)]
  # fragment 1's age counts merges of fragment 1 only: 0 (not stale,
  # though fragment 0 merged since)
  _publish(store, 'l1', 1, _delta(frags, 1, 4), 1, 0)
  syncer.poll()
  assert syncer.ready(time.time())
  before = jax.tree.map(np.copy, syncer.params)
  info = syncer.merge()
  assert info['fragment'] == 1 and info['ages'] == [0., 0.]
  for p, same in ((0, True), (1, False)):
    for x, y in zip(frags.take(syncer.params, p), frags.take(before, p)):
      assert np.array_equal(x, y) == same
  assert syncer.counters['fragment_versions'] == [1, 1]
  assert syncer.counters['consumed'] == {'l0': 1, 'l1': 1}
  assert syncer.counters['consumed_above'] == {}
  # the merged and consumed payloads are never read again
  syncer.poll()
  assert not syncer.pending
  # two more merges of fragment 0 make a fragment-0 payload on its version
  # 0 stale (max_staleness 1), dropped and counted
  for seq in (2, 3):
    _publish(store, 'l0', seq, _delta(frags, 0, seq), 0, seq - 1)
    syncer.poll()
    assert syncer.merge()['fragment'] == 0
  _publish(store, 'l1', 2, d10, 0, 0, tokens=7.)
  syncer.poll()
  assert syncer.merge() is None
  c = syncer.counters
  assert (c['payloads_stale'], c['tokens_discarded'],
          c['fragment_versions']) == (1, 7., [3, 1])
  store.close()


def test_a_syncer_refuses_a_store_of_another_num_fragments(tmp_path):
  init = _init()
  store = store_lib.Store(tmp_path)
  syncer_lib.Syncer(store, init, syncer_lib.SyncerOptions(), init=init)
  with pytest.raises(ValueError, match='num_fragments=2, but the store'):
    syncer_lib.Syncer(store, init,
                      syncer_lib.SyncerOptions(num_fragments=2))
  with pytest.raises(ValueError, match='num_fragments'):
    syncer_lib.SyncerOptions(num_fragments=0).check()
  store.close()


# ------------------------------------------- a syncer and two learners ---
ROOT = pathlib.Path(__file__).resolve().parents[2]
CONFIG = [f'--config={ROOT / "configs" / "diloco_lm.py"}:mlp',
          '--config.model.hidden=16', '--config.data.seq_len=32',
          '--config.data.max_bytes=300000', '--config.batch_size=8',
          '--config.outer.sync_every=4', '--config.num_steps=100000']
VERSIONS = 6  # the syncer stops there; the store keeps every version


def _start(tmp, name, module, *args):
  env = dict(os.environ, JAX_PLATFORMS='cpu', PYTHONPATH=str(ROOT),
             XLA_FLAGS='')
  log = tmp / f'{name}.log'
  with open(log, 'w') as out:
    proc = subprocess.Popen(
        [sys.executable, '-m', f'loc_opt.train.async_learners.{module}',
         *CONFIG, f'--store={tmp / "store"}', *args], cwd=ROOT, env=env,
        stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
  return proc, log


def _events(log, event):
  out = []
  for line in log.read_text().splitlines():
    if line.startswith('{'):
      e = json.loads(line)
      if e['event'] == event:
        out.append(e)
  return out


@pytest.fixture(scope='module')
def two_fragments(tmp_path_factory):
  tmp = tmp_path_factory.mktemp('async_fragments')
  procs = {'syncer': _start(
      tmp, 'syncer', 'syncer', '--num_fragments=2', '--quorum=2',
      '--grace_cap_s=0.2', '--poll_s=0.2', f'--max_versions={VERSIONS}')}
  for i, name in enumerate('ab'):
    procs[name] = _start(tmp, name, 'learner', f'--learner={name}',
                         f'--index={i}', '--num_learners=2',
                         '--num_fragments=2', '--slowdown_s=0.1',
                         f'--stop_at_version={VERSIONS}')
  # a learner with another num_fragments refuses to start
  other = _start(tmp, 'other', 'learner', '--learner=other',
                 '--num_fragments=1')
  try:
    for name, (proc, log) in procs.items():
      assert proc.wait(timeout=240) == 0, log.read_text()[-3000:]
    refused = other[0].wait(timeout=120), other[1].read_text()
  finally:
    procs['other'] = other
    for proc, _ in procs.values():
      if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
  return tmp, {n: log for n, (_, log) in procs.items()}, refused


def _tiny_params():
  from configs import diloco_lm  # pylint: disable=g-import-not-at-top
  c = diloco_lm.get_config('mlp')
  c.model.hidden = 16
  return syncer_lib.init_params(c)


def test_payloads_carry_one_fragment_and_its_bytes(two_fragments):
  tmp, logs, _ = two_fragments
  params = _tiny_params()
  frags = wire.Fragments(params, 2)
  sizes = [x.size for x in jax.tree.leaves(params)]
  full = 4 * sum(sizes)
  store = store_lib.Store(tmp / 'store')
  for name in 'ab':
    payloads = _events(logs[name], 'payload')
    assert len(payloads) >= 4
    # fragment 1 after steps 2, 6, ...; fragment 0 after steps 4, 8, ...
    assert [e['fragment'] for e in payloads] == [
        (e['inner_steps'] // 2) % 2 for e in payloads]
    assert {e['fragment'] for e in payloads} == {0, 1}
    for e in payloads:
      want = 4 * sum(sizes[i] for i in frags.leaves[e['fragment']])
      assert e['bytes'] == want and 0.4 < e['bytes'] / full < 0.6
      assert e['steps'] in (2, 4)  # fragment 1's first covers H / P steps
    e = payloads[-1]
    stored = store.read_payload(name, e['seq']).delta
    assert [np.shape(x) for x in jax.tree.leaves(stored)] == [
        x.shape for x in frags.like[e['fragment']]]
  store.close()


def test_both_fragments_merge_and_no_payload_twice(two_fragments):
  _, logs, _ = two_fragments
  merges = _events(logs['syncer'], 'merge')
  assert [m['version'] for m in merges] == list(range(1, VERSIONS + 1))
  assert {m['fragment'] for m in merges} == {0, 1}
  merged = [tuple(x) for m in merges for x in m['payloads']]
  assert len(merged) == len(set(merged))
  # every payload merged holds the merge's fragment
  fragment_of = {(n, e['seq']): e['fragment'] for n in 'ab'
                 for e in _events(logs[n], 'payload')}
  for m in merges:
    assert {fragment_of[tuple(x)] for x in m['payloads']} == {m['fragment']}


def test_a_fragment_changes_only_at_its_merges(two_fragments):
  tmp, logs, _ = two_fragments
  params = _tiny_params()
  frags = wire.Fragments(params, 2)
  store = store_lib.Store(tmp / 'store')
  assert store.versions() == list(range(VERSIONS + 1))
  merges = {m['version']: m['fragment']
            for m in _events(logs['syncer'], 'merge')}
  previous = jax.tree.leaves(store.read_global(0, params)[0])
  for v in range(1, VERSIONS + 1):
    now, _, meta = store.read_global(v, params)
    now = jax.tree.leaves(now)
    for p in range(2):
      changed = [not np.array_equal(now[i], previous[i])
                 for i in frags.leaves[p]]
      assert any(changed) if p == merges[v] else not any(changed), (v, p)
    previous = now
  assert meta['num_fragments'] == 2
  assert meta['fragment_versions'] == [
      sum(f == p for f in merges.values()) for p in range(2)]
  # the learners took merged fragments as they appeared
  took = [e for n in 'ab' for e in _events(logs[n], 'took')]
  assert {q for e in took for q in e['fragments']} == {0, 1}
  store.close()


def test_a_learner_of_another_num_fragments_refuses_to_start(two_fragments):
  _, _, (code, out) = two_fragments
  assert code != 0
  assert 'num_fragments=1, but the syncer' in out, out[-2000:]


# ------------------------------------------------- a learner, in-process ---
def test_a_learner_takes_only_the_fragments_merged_since(tmp_path):
  from configs import diloco_lm  # pylint: disable=g-import-not-at-top
  from loc_opt.train.async_learners import learner as learner_lib  # pylint: disable=g-import-not-at-top
  c = diloco_lm.get_config('mlp')
  c.model.hidden, c.data.seq_len, c.data.max_bytes = 16, 32, 300000
  c.batch_size, c.outer.sync_every, c.num_steps = 8, 4, 1000
  init = syncer_lib.init_params(c)
  store = store_lib.Store(tmp_path)
  syncer = syncer_lib.Syncer(store, init, syncer_lib.SyncerOptions(
      num_fragments=2, grace_cap_s=0.), init=init)
  frags = syncer.frags
  learners = {alpha: learner_lib.Learner(c, store, f'l{i}', num_fragments=2,
                                         alpha=alpha, wait_s=5.)
              for i, alpha in enumerate((0., 0.5))}
  for learner in learners.values():
    meta = learner.round()
    assert (meta['fragment'], meta['steps'], learner.step) == (1, 2, 2)
  syncer.poll()
  assert syncer.merge(1)['fragment'] == 1
  glob = jax.tree.leaves(store.read_global(1, init)[0])
  for alpha, learner in learners.items():
    own = [np.asarray(x) for x in jax.tree.leaves(learner.params)]
    assert learner._take(1) and learner.took == [1]
    now = [np.asarray(x) for x in jax.tree.leaves(learner.params)]
    anchor = [np.asarray(x) for x in jax.tree.leaves(learner.anchor)]
    for i in frags.leaves[1]:  # merged: taken (mixed with alpha)
      np.testing.assert_allclose(now[i], alpha * own[i] + (1 - alpha)
                                 * glob[i], rtol=1e-6, atol=1e-7)
      np.testing.assert_array_equal(anchor[i], glob[i])
      assert not np.array_equal(now[i], own[i])
    for i in frags.leaves[0]:  # not merged: its own progress stays
      np.testing.assert_array_equal(now[i], own[i])
    assert learner.fragment_versions == [0, 1] and learner.since == [0, 2]
    # fragment 0 next: 4 steps since the start, on its version 0; then
    # fragment 1: 4 steps since it was taken, on its version 1
    meta = learner.round()
    assert (meta['fragment'], meta['steps'],
            meta['base_fragment_version']) == (0, 4, 0)
    meta = learner.round()
    assert (meta['fragment'], meta['steps'],
            meta['base_fragment_version']) == (1, 4, 1)
  store.close()
