"""Asynchronous learners and a syncer as separate processes, exchanging
through an Orbax store in a temporary directory.

One scenario (a module fixture; 7 process starts of a tiny :mlp model)
is run once: a syncer (quorum 2) and learners ``a`` and ``b`` start; ``b`` is
killed with SIGKILL and the merges go on with ``a`` alone; ``b`` restarts
and rejoins from the newest merged model; the syncer is killed with SIGKILL
while the learners keep publishing, restarts, resumes from its checkpoint
(the newest global version) and merges what they published meanwhile. The
tests below each check one part of it from the processes' JSON-lines logs
and from the store. Last, a learner ``c`` is added mid-run and joins, is
killed and restarts with ``--rejoin_state=peer``. A second run has a
learner of 2 processes (``--local_processes=2``).
"""

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from loc_opt.train.async_learners import store as store_lib
from loc_opt.train.async_learners import wire

ROOT = pathlib.Path(__file__).resolve().parents[2]
STEP_TIMEOUT_S = 180  # one phase of the scenario, on a busy 2-core machine
CONFIG = [f'--config={ROOT / "configs" / "diloco_lm.py"}:mlp',
          '--config.model.hidden=16', '--config.data.seq_len=32',
          '--config.data.max_bytes=300000', '--config.batch_size=8',
          '--config.outer.sync_every=4', '--config.num_steps=100000']


class _Procs:
  """The scenario's processes: each in its own session (process group),
  its output in a file; all killed at the end."""

  def __init__(self, tmp: pathlib.Path):
    self.tmp, self.procs, self.logs = tmp, {}, {}
    self.store = tmp / 'store'
    self.env = dict(os.environ, JAX_PLATFORMS='cpu', PYTHONPATH=str(ROOT),
                    XLA_FLAGS='')

  def start(self, name: str, module: str, *args: str) -> None:
    log = self.tmp / f'{name}.{len(self.logs.get(name, []))}.log'
    self.logs.setdefault(name, []).append(log)
    with open(log, 'w') as out:
      self.procs[name] = subprocess.Popen(
          [sys.executable, '-m', f'loc_opt.train.async_learners.{module}',
           *CONFIG, f'--store={self.store}', *args],
          cwd=ROOT, env=self.env, stdout=out, stderr=subprocess.STDOUT,
          start_new_session=True)

  def syncer(self) -> None:
    self.start('syncer', 'syncer', '--quorum=2', '--liveness_s=4',
               '--max_staleness=3', '--grace_cap_s=0.2', '--poll_s=0.2')

  def learner(self, name: str, index: int, *args: str) -> None:
    self.start(name, 'learner', f'--learner={name}', f'--index={index}',
               '--num_learners=2', '--slowdown_s=0.1',
               *(['--codec=int8'] if name == 'b' else []), *args)

  def kill(self, name: str) -> None:
    proc = self.procs.pop(name)
    if proc.poll() is None:
      os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)

  def kill_all(self) -> None:
    for name in list(self.procs):
      self.kill(name)

  def events(self, name: str, run: int | None = None) -> list[dict]:
    out = []
    for log in (self.logs[name] if run is None else [self.logs[name][run]]):
      for line in log.read_text().splitlines():
        if line.startswith('{'):
          try:
            out.append(json.loads(line))
          except json.JSONDecodeError:
            pass  # a line cut by SIGKILL
    return out

  def wait(self, what: str, predicate) -> None:
    deadline = time.monotonic() + STEP_TIMEOUT_S
    while time.monotonic() < deadline:
      for name, proc in self.procs.items():
        if proc.poll() is not None:
          raise AssertionError(f'{name} exited ({proc.returncode}) while '
                               f'waiting for {what}:\n'
                               + self.logs[name][-1].read_text()[-3000:])
      if predicate():
        return
      time.sleep(0.2)
    raise AssertionError(f'timed out waiting for {what}')

  def merges(self, run: int | None = None) -> list[dict]:
    return [e for e in self.events('syncer', run) if e['event'] == 'merge']

  def payloads(self, name: str) -> list[dict]:
    return [e for e in self.events(name) if e['event'] == 'payload']


@pytest.fixture(scope='module')
def scenario(tmp_path_factory):
  p = _Procs(tmp_path_factory.mktemp('async_learners'))
  marks = {}
  try:
    p.syncer()
    p.learner('a', 0)
    p.learner('b', 1)
    # (b starts after a: under load a's payloads alone can make 2 merges)
    p.wait('2 merges and a payload of b',
           lambda: len(p.merges()) >= 2 and p.payloads('b'))
    # a learner dies: merges go on without it
    marks['b_seq_before'] = max(e['seq'] for e in p.payloads('b'))
    p.kill('b')
    marks['kill_b_version'] = p.merges()[-1]['version']
    p.wait('3 merges after b died', lambda: p.merges()[-1]['version']
           >= marks['kill_b_version'] + 3)
    # it restarts and rejoins
    p.learner('b', 1)
    p.wait('a merge of the restarted b', lambda: any(
        ['b', s] in m['payloads'] for m in p.merges()
        for s in range(marks['b_seq_before'] + 1, 10_000)))
    # the syncer dies; the learners go on; it restarts and resumes
    p.kill('syncer')
    marks['kill_syncer_version'] = p.merges()[-1]['version']
    counts = {n: len(p.payloads(n)) for n in 'ab'}
    p.wait('2 payloads each while the syncer is down', lambda: all(
        len(p.payloads(n)) >= counts[n] + 2 for n in 'ab'))
    marks['down_payloads'] = {
        n: [e['seq'] for e in p.payloads(n)][counts[n]:] for n in 'ab'}
    p.syncer()
    p.wait('2 merges of the restarted syncer',
           lambda: len(p.merges(run=1)) >= 2)
    # a learner added mid-run joins the same way
    marks['c_added_version'] = p.merges()[-1]['version']
    p.learner('c', 1)
    p.wait('a merge of the added learner c', lambda: any(
        l == 'c' for m in p.merges() for l, _ in m['payloads']))
    # c dies and restarts with a peer's inner state
    p.wait('an inner state of c', lambda: any(
        e['event'] == 'inner' for e in p.events('c')))
    p.kill('c')
    p.learner('c', 1, '--rejoin_state=peer')
    p.wait('the restarted c', lambda: any(
        e['event'] == 'start' for e in p.events('c', 1)))
  finally:
    p.kill_all()
  return p, marks


def test_merges_go_on_after_a_learner_is_killed(scenario):
  p, marks = scenario
  after = [m for m in p.merges(run=0)
           if m['version'] > marks['kill_b_version']]
  # the merges right after the kill hold a's payloads (b's last ones may be
  # among the first); later ones, until b is back, only a's
  assert len(after) >= 3
  learners_after = [{l for l, _ in m['payloads']} for m in after[1:3]]
  assert all(ls == {'a'} for ls in learners_after), learners_after


def test_the_restarted_learner_rejoins_from_the_newest_model(scenario):
  p, marks = scenario
  first, second = (p.events('b', 0), p.events('b', 1))
  start = [e for e in second if e['event'] == 'start'][0]
  assert start['rejoined']
  assert start['version'] >= marks['kill_b_version'] + 3
  assert start['seq'] == marks['b_seq_before'] + 1  # numbers continue
  # its own inner state and step count were kept (rejoin_state='keep')
  assert start['step'] > 0
  assert [e for e in first if e['event'] == 'start'][0]['rejoined'] is False


def test_the_restarted_syncer_resumes_from_its_checkpoint(scenario):
  p, marks = scenario
  resumed = [e for e in p.events('syncer', 1) if e['event'] == 'resumed']
  assert resumed and resumed[0]['version'] == marks['kill_syncer_version']
  new = p.merges(run=1)
  assert new[0]['version'] == marks['kill_syncer_version'] + 1
  merged = {tuple(x) for m in new for x in m['payloads']}
  # what the learners published while it was down reached a merge (or was
  # dropped as stale, which the counters show)
  down = {(n, s) for n, seqs in marks['down_payloads'].items() for s in seqs}
  assert down & merged, (down, merged)


def test_a_learner_added_mid_run_joins_from_the_newest_model(scenario):
  p, marks = scenario
  start = [e for e in p.events('c') if e['event'] == 'start'][0]
  assert not start['rejoined'] and start['seq'] == 0 and start['step'] == 0
  assert start['version'] >= marks['c_added_version']


def test_a_learner_restarted_with_peer_takes_a_peers_inner_state(scenario):
  p, _ = scenario
  taken = [e for e in p.events('c', 1) if e['event'] == 'inner_state'][0]
  assert taken['requested'] == 'peer' and taken['source'] == 'peer', taken
  peer = taken['source_learner']
  assert peer in ('a', 'b')
  # the step count and the optimizer state are those the peer published
  # with that state (its moment: a float64 checksum of every leaf)
  published = [e for e in p.events(peer) if e['event'] == 'inner'
               and e['seq'] == taken['source_seq']]
  assert published, (peer, taken['source_seq'])
  assert taken['step'] == published[-1]['step']
  assert taken['moment'] == published[-1]['moment']
  own = [e for e in p.events('c', 0) if e['event'] == 'inner'][-1]
  assert (taken['step'], taken['moment']) != (own['step'], own['moment'])
  start = [e for e in p.events('c', 1) if e['event'] == 'start'][0]
  assert start['rejoined'] and start['step'] == taken['step']


def test_no_payload_is_merged_twice(scenario):
  p, _ = scenario
  merged = [tuple(x) for m in p.merges() for x in m['payloads']]
  assert merged and len(merged) == len(set(merged))
  versions = [m['version'] for m in p.merges()]
  assert versions == sorted(versions) and len(set(versions)) == len(versions)


def test_the_store_counts_what_was_merged_and_sent(scenario):
  p, _ = scenario
  store = store_lib.Store(p.store)
  logged = p.merges()[-1]['version']
  # The syncer writes a version, then logs its merge line: the SIGKILL at
  # the end can fall between the two, leaving one version unlogged.
  assert store.latest_version() in (logged, logged + 1)
  from loc_opt.train.async_learners import syncer  # pylint: disable=g-import-not-at-top
  _, _, meta = store.read_global(logged, syncer.init_params(_tiny()), None)
  assert meta['syncer_starts'] == 2
  assert meta['merges'] == logged
  assert meta['payloads_merged'] == sum(len(m['payloads'])
                                        for m in p.merges())
  # b's payloads are int8: a quarter of a's float32 bytes plus scales
  a_bytes = p.payloads('a')[0]['bytes']
  b_bytes = p.payloads('b')[0]['bytes']
  assert a_bytes / 4.5 < b_bytes < a_bytes / 3.5
  store.close()


def _tiny():
  from configs import diloco_lm  # pylint: disable=g-import-not-at-top
  c = diloco_lm.get_config('mlp')
  c.model.hidden = 16
  return c


def test_a_learner_of_two_processes_joins_the_merges(tmp_path):
  # A syncer, learner m as 2 local processes (jax.distributed, gloo, a free
  # port: --local_processes) and learner s as one process.
  p = _Procs(tmp_path)
  try:
    p.syncer()
    p.learner('m', 0, '--local_processes=2')
    p.learner('s', 1)
    p.wait('2 merges with payloads of m and of s', lambda: sum(
        {l for l, _ in m['payloads']} == {'m', 's'} for m in p.merges())
        >= 2)
  finally:
    p.kill_all()
  events = p.events('m')
  starts = [e for e in events if e['event'] == 'start']
  assert sorted(e['process'] for e in starts) == [0, 1]
  assert all(e['processes'] == 2 for e in starts)
  # one write per payload: process 0's, each number once, and merged
  seqs = [e['seq'] for e in p.payloads('m')]
  assert seqs and len(seqs) == len(set(seqs))
  assert {e['process'] for e in p.payloads('m')} == {0}
  merged = {s for m in p.merges() for l, s in m['payloads'] if l == 'm'}
  assert merged and merged <= set(seqs)
  # both processes took the same merged versions, with the same values
  took = {i: {e['version']: e['moment'] for e in events
              if e['event'] == 'took' and e['process'] == i} for i in (0, 1)}
  both = set(took[0]) & set(took[1])
  assert both and all(took[0][v] == took[1][v] for v in both), took


def test_rejoin_with_peer_falls_back_to_own_then_fresh(tmp_path):
  import io  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  from loc_opt.train.async_learners import learner as learner_lib  # pylint: disable=g-import-not-at-top
  from loc_opt.train.async_learners import syncer as syncer_lib  # pylint: disable=g-import-not-at-top
  config = _tiny()
  config.data.seq_len, config.data.max_bytes = 32, 300_000
  store = store_lib.Store(tmp_path)
  init = syncer_lib.init_params(config)
  syncer_lib.Syncer(store, init, syncer_lib.SyncerOptions(), init=init)

  def start(name):
    log = io.StringIO()
    learner = learner_lib.Learner(config, store, name, rejoin_state='peer',
                                  log=log)
    line = [json.loads(l) for l in log.getvalue().splitlines()
            if '"inner_state"' in l]
    assert len(line) == 1
    return learner, line[0]

  fresh, line = start('x')  # no peer, no own state
  assert (line['source'], line['step'], fresh.step) == ('fresh', 0, 0)
  state = {'inner': jax.tree.map(lambda v: np.asarray(v) + 1,
                                 fresh.inner_state), 'step': np.int64(12)}
  store.save_learner_state('x', 0, state, {'base_version': 0, 'step': 12,
                                           'wall': time.time()})
  _, line = start('x')  # its own
  assert (line['source'], line['source_learner'], line['step']) == (
      'own', 'x', 12)
  now = time.time()
  for peer, step, base, wall in (('y', 40, 0, now), ('z', 80, 5, now - 1e3)):
    store.save_learner_state(peer, 3, dict(state, step=np.int64(step)),
                             {'base_version': base, 'step': step,
                              'wall': wall})
  got, line = start('x')  # y's: z is not live (its newest is too old)
  assert (line['source'], line['source_learner'], line['source_seq'],
          line['step'], got.step) == ('peer', 'y', 3, 40, 40)
  _, line = start('w')  # a learner added mid-run takes the peer's too
  assert (line['source'], line['source_learner'], line['step']) == (
      'peer', 'y', 40)
  assert store.newest_peer_state('x', now=now, liveness_s=2e3)['learner'] \
      == 'z'  # live, it would win: on a newer base version
  store.close()


# ------------------------------------------------- store and wire, alone ---
def test_versions_are_atomic_and_never_overwritten(tmp_path):
  store = store_lib.Store(tmp_path)
  params = {'w': np.arange(6, dtype=np.float32).reshape(2, 3)}
  store.publish_global(0, params, {'m': np.zeros(3, np.float32)}, {'n': 1})
  # a write cut short (Orbax's temporary directory, or a directory without
  # Orbax's commit marker) is never listed
  (tmp_path / 'global' / '1.orbax-checkpoint-tmp-12345').mkdir()
  (tmp_path / 'global' / '2' / 'params').mkdir(parents=True)
  assert store.versions() == [0]
  with pytest.raises(FileExistsError, match='never overwritten'):
    store.publish_global(0, params, {'m': np.ones(3, np.float32)}, {})
  got, outer, meta = store_lib.Store(tmp_path).read_global(
      0, params, {'m': np.zeros(3, np.float32)})
  np.testing.assert_array_equal(got['w'], params['w'])
  assert meta == {'n': 1, 'version': 0} and outer['m'].shape == (3,)
  with pytest.raises(ValueError, match='learner id'):
    store.publish_payload('a/b', 0, params, {})
  store.close()


def test_a_version_deleted_while_a_reader_opens_the_store_is_listed_again(
    tmp_path, monkeypatch):
  # The syncer deletes old versions (max_to_keep) while learners list them;
  # Orbax then fails on a step it had just listed, also when a reader first
  # opens its manager. The reader lists the directory again.
  store = store_lib.Store(tmp_path / 'store')
  params = {'w': np.ones((3,), np.float32)}
  store.publish_global(0, params, {'m': np.zeros((3,), np.float32)}, {})
  real, failures = store_lib._manager, []

  def flaky(*args, **kwargs):
    if not failures:
      failures.append(1)
      raise FileNotFoundError('a step deleted while listing')
    return real(*args, **kwargs)

  monkeypatch.setattr(store_lib, '_manager', flaky)
  reader = store_lib.Store(tmp_path / 'store')
  assert reader.versions() == [0] and failures == [1]
  reader.close()
  store.close()


@pytest.mark.parametrize('codec, tol', [(None, 0.), ('int8', 0.02)])
def test_payloads_round_trip_through_the_store(tmp_path, codec, tol):
  delta = {'a': np.linspace(-1, 1, 300, dtype=np.float32),
           'b': {'c': np.ones((3, 5), np.float32)}}
  stored, nbytes, decoded = wire.encode(delta, codec, seed=3)
  assert nbytes == (1260 if codec is None else 780)  # 315 x 4; int8 blocks
  store = store_lib.Store(tmp_path)
  store.publish_payload('a', 7, stored, {'codec': codec, 'seed': 3})
  assert list(store.new_payloads({})) == [('a', 7)]
  assert list(store.new_payloads({'a': 7})) == []
  back = store.read_payload('a', 7)
  got = wire.decode(back.delta, back.meta['codec'], back.meta['seed'], delta)
  for x, y, z in zip(*(jax_leaves(t) for t in (got, decoded, delta))):
    np.testing.assert_array_equal(x, y)  # what the learner's feedback saw
    assert np.abs(x - z).max() <= tol
  store.close()


def jax_leaves(tree):
  import jax  # pylint: disable=g-import-not-at-top
  return jax.tree.leaves(tree)


def test_the_chaos_schedule_is_seeded_and_kills_only_live_learners():
  from experiments import _chaos_schedule as async_chaos  # pylint: disable=g-import-not-at-top
  events = async_chaos.schedule(0, 100., 6, 15.)
  assert events == async_chaos.schedule(0, 100., 6, 15.)
  assert events != async_chaos.schedule(1, 100., 6, 15.)
  assert [e for e in events if e[2] == 'syncer'] == [(50., 'kill', 'syncer')]
  down = set()
  for t, what, proc in events:
    if proc == 'syncer':
      continue
    assert 0 <= t and (proc not in down) == (what == 'kill'), (t, what, proc)
    (down.add if what == 'kill' else down.discard)(proc)
  assert not down  # every killed learner is restarted


def test_the_syncer_merges_with_the_decoupled_rules_and_drops_stale(
    tmp_path):
  import jax  # pylint: disable=g-import-not-at-top
  import optax  # pylint: disable=g-import-not-at-top
  from loc_opt.outer.decoupled_diloco import merge_stacked  # pylint: disable=g-import-not-at-top
  from loc_opt.outer.decoupled_diloco import token_weight  # pylint: disable=g-import-not-at-top
  from loc_opt.train.async_learners import syncer as syncer_lib  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(0)
  init = {'embed': {'embedding': rng.normal(size=(4, 3)).astype(np.float32)},
          'dense': {'kernel': rng.normal(size=(3, 5)).astype(np.float32)}}
  store = store_lib.Store(tmp_path)
  opts = syncer_lib.SyncerOptions(quorum=2, max_staleness=1, grace_cap_s=0.)
  syncer = syncer_lib.Syncer(store, init, opts, init=init)
  assert store.versions() == [0]
  deltas = [jax.tree.map(lambda x: rng.normal(size=x.shape).astype(
      np.float32), init) for _ in range(3)]
  tokens = [100., 300., 50.]
  for i, (d, t) in enumerate(zip(deltas, tokens)):
    store.publish_payload(f'l{i}', 0, d, {
        'base_version': 0, 'tokens': t, 'steps': 4., 'wall': 0.})
  syncer.poll()
  assert syncer.ready(time.time())  # 3 learners >= quorum, no grace
  info = syncer.merge()
  assert sorted(map(tuple, info['payloads'])) == [('l0', 0), ('l1', 0),
                                                   ('l2', 0)]
  # the same numbers by hand: token weights, merge_stacked (embedding
  # averaged directly), DiLoCo's Nesterov step
  w = np.asarray(token_weight(np.array(tokens, np.float32),
                              np.full(3, 4., np.float32)))
  leaves = [np.stack(x) for x in zip(*[jax.tree.leaves(d) for d in deltas])]
  merged = merge_stacked(leaves, w, direct=[False, True])
  tx = optax.sgd(0.7, momentum=0.9, nesterov=True)
  upd, _ = tx.update(jax.tree.unflatten(jax.tree.structure(init), merged),
                     tx.init(init), init)
  want = optax.apply_updates(init, upd)
  for got, ref in zip(jax.tree.leaves(syncer.params), jax.tree.leaves(want)):
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6)
  # version 1 now; two more merges make a payload on version 0 too old
  for v in (1, 2):
    store.publish_payload('l0', v, deltas[0], {
        'base_version': v, 'tokens': 10., 'steps': 1., 'wall': 0.})
    syncer.poll()
    assert syncer.merge() is not None
  store.publish_payload('l1', 1, deltas[1], {
      'base_version': 0, 'tokens': 7., 'steps': 1., 'wall': 0.})
  syncer.poll()
  assert syncer.merge() is None  # nothing usable: stale, counted
  c = syncer.counters
  assert (c['payloads_stale'], c['tokens_discarded']) == (1, 7.)
  assert c['consumed'] == {'l0': 2, 'l1': 1, 'l2': 0}
  syncer.poll()
  assert not syncer.pending  # consumed payloads are not read again
  store.close()
