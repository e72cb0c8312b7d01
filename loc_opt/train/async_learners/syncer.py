r"""The syncer of asynchronous learners: a host-only process that merges
whatever payloads have arrived in the store and publishes global versions.

Run it next to (or on another machine than) the learners, all pointed at
one store::

  python -m loc_opt.train.async_learners.syncer \
      --config=configs/diloco_lm.py:mlp --store=/shared/run1 --quorum=2

Each poll it reads the new payloads (``STORE/payloads/<learner>/<n>``, see
:mod:`~loc_opt.train.async_learners.store`) and decides a merge with
Decoupled DiLoCo's rules, in wall-clock seconds:

* **quorum**: once ``K`` distinct learners have a fresh payload waiting (or
  every *live* learner, when fewer than ``K`` are live: a learner is live
  if its newest payload was written within ``liveness_s``), at time ``q``,
* **grace window**: it waits ``g = clip(gamma * slack, 0, grace_cap_s)``,
  ``slack = tau * xi_step - (q - open) - xi_sync`` (the rule of
  :mod:`loc_opt.outer.decoupled_clock`, with ``xi_step`` the slowest
  learner's seconds per inner step as the payloads report it, ``open`` the
  time of the previous merge and ``xi_sync`` an EMA of the merge time),
  then merges every payload that arrived by ``q + g`` (two payloads of one
  learner, e.g. of a fast learner while the syncer was down, enter as two
  entries: each is a different round's progress);
* **staleness bound**: a payload whose base version is more than
  ``max_staleness`` versions old is dropped (counted with its tokens);
* **merge**: each payload weighted by ``c_tokens^2 / c_steps``
  (:func:`loc_opt.outer.decoupled_diloco.token_weight`, or uniform),
  merged by :func:`loc_opt.outer.decoupled_diloco.merge_stacked` (RDA with
  embeddings averaged directly, or the weighted average), then the outer
  optimizer (Nesterov SGD, DiLoCo's 0.7 / 0.9 by default) with the
  staleness options of :mod:`loc_opt.outer.staleness`, fed the
  merge-weighted mean age of the payloads.

Every merge is one atomic write of global version ``v + 1`` holding the
parameters, the outer optimizer state and the syncer's counters, among them
the highest payload number consumed per learner: a payload is consumed
(merged or dropped) once and never again, also across syncer restarts. A
restarted syncer resumes from the newest version; the learners keep training
and publishing meanwhile, and what they published while it was down is
merged when it is back.

**Fragments.** With ``num_fragments = P > 1`` the model is split as the
SPMD version splits it (:class:`~loc_opt.train.async_learners.wire.Fragments`:
whole tensors bin-packed, :func:`loc_opt.outer.balanced_fragments`); a
learner publishes one fragment's pseudo-gradient every ``H / P`` inner
steps, fragment ``p`` at offset ``p H / P`` (Streaming DiLoCo's staggered
schedule, as :func:`loc_opt.outer.decoupled_timeline`), and every rule
above applies per fragment: the quorum counts the learners with a fresh
payload *of that fragment*, its grace window opens at that fragment's
previous merge, a payload's age is the number of merges *of its fragment*
since the fragment version it builds on, and each fragment has its own
outer optimizer state. A merge of fragment ``p`` changes only fragment
``p`` of the parameters; it still publishes one global version ``v + 1``
(the whole model), whose counters hold each fragment's version
(``fragment_versions``: its merges so far). The store records
``num_fragments``; a learner or a restarted syncer with another value
refuses to start. ``P = 1`` (the default) is the whole model as one
fragment, every payload carrying every parameter.
"""

import dataclasses
import functools
import json
import re
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax

from loc_opt import _checks
from loc_opt import models
from loc_opt.outer import _fragments
from loc_opt.outer import _local
from loc_opt.outer.decoupled_diloco import DIRECT_PATTERN
from loc_opt.outer.decoupled_diloco import MERGES
from loc_opt.outer.decoupled_diloco import merge_stacked
from loc_opt.outer.decoupled_diloco import token_weight
from loc_opt.outer.decoupled_diloco import WEIGHTINGS
from loc_opt.outer import staleness
from loc_opt.train.async_learners import store as store_lib
from loc_opt.train.async_learners import wire


@dataclasses.dataclass(frozen=True)
class SyncerOptions:
  """The syncer's settings (the flags of ``python -m ...syncer``)."""

  quorum: int = 1  # K
  grace: float = 0.2  # gamma
  grace_cap_s: float = 2.0
  overlap: float = 2.0  # tau, in inner steps
  max_staleness: int = 4  # versions
  liveness_s: float = 60.0
  merge: str = 'rda'
  weighting: str = 'tokens'
  outer_lr: float = 0.7
  outer_momentum: float = 0.9
  age_power: float = 0.0
  correction: float = 0.0
  restart_every: int = 0
  poll_s: float = 0.05
  num_fragments: int = 1  # P (wire.Fragments); the learners' must match

  def check(self) -> 'SyncerOptions':
    if not isinstance(self.quorum, int) or self.quorum < 1:
      raise ValueError(f'quorum must be an int >= 1, got {self.quorum!r}')
    _checks.positive_int(self.num_fragments, 'num_fragments')
    _checks.in_interval(self.grace, 'grace', 0, 1)
    for name in ('grace_cap_s', 'overlap', 'liveness_s', 'poll_s',
                 'age_power'):
      _checks.nonnegative_float(getattr(self, name), name)
    if not isinstance(self.max_staleness, int) or self.max_staleness < 0:
      raise ValueError('max_staleness must be an int >= 0, got '
                       f'{self.max_staleness!r}')
    _checks.one_of(self.merge, 'merge', MERGES)
    _checks.one_of(self.weighting, 'weighting', WEIGHTINGS)
    return self


def grace_window(gamma: float, tau: float, step_s: float, quorum_wait_s: float,
                 sync_s: float, cap_s: float) -> float:
  """``clip(gamma * (tau * step_s - quorum_wait_s - sync_s), 0, cap_s)``:
  Decoupled DiLoCo's grace window (its Eq. 3 as quoted second-hand), the
  rule :mod:`loc_opt.outer.decoupled_clock` applies in ticks."""
  slack = tau * step_s - quorum_wait_s - sync_s
  return min(cap_s, max(0., gamma * slack))


def init_params(config: ml_collections.ConfigDict) -> Any:
  """The model's initial parameters (seed ``config.seed``) on the host."""
  model = models.build_model(config.model)
  return jax.tree.map(np.asarray, model.init(jax.random.key(config.seed)))


def direct_leaves(params: Any, pattern: str | None = DIRECT_PATTERN
                  ) -> list[bool]:
  """Per leaf, whether RDA averages it directly (embeddings)."""
  if pattern is None:
    return [False] * len(jax.tree.leaves(params))
  regex = re.compile(pattern)
  return [bool(regex.search(_fragments._path_name(path)))  # pylint: disable=protected-access
          for path, _ in jax.tree_util.tree_flatten_with_path(params)[0]]


@dataclasses.dataclass
class _Pending:
  learner: str
  seq: int
  meta: dict[str, Any]
  delta: Any
  seen_at: float
  fragment: int = 0
  base: int = 0  # the fragment's global version the delta builds on


def _fresh_counters(num_fragments: int = 1) -> dict[str, Any]:
  # consumed: learner -> n, every payload <= n consumed; consumed_above:
  # learner -> the payload numbers > n consumed too (payloads of one
  # fragment merged while an older one of another fragment waits)
  return {'merges': 0, 'payloads_merged': 0, 'payloads_stale': 0,
          'payloads_unusable': 0, 'payloads_lost': 0, 'tokens_merged': 0.,
          'tokens_discarded': 0.,
          'bytes_received': 0, 'consumed': {}, 'consumed_above': {},
          'merged_by_learner': {}, 'syncer_starts': 0,
          'num_fragments': num_fragments,
          'fragment_versions': [0] * num_fragments}


def _payload_fragment(meta: dict[str, Any], num_fragments: int
                      ) -> tuple[int, int]:
  """``(fragment, base)`` of a payload's meta: its fragment and the global
  version of that fragment it builds on (one fragment: ``base_version``)."""
  p = meta.get('fragment', 0)
  if not isinstance(p, int) or not 0 <= p < num_fragments:
    raise ValueError(f'payload fragment {p!r} is not in [0, num_fragments='
                     f'{num_fragments})')
  if 'base_fragment_version' in meta:
    return p, int(meta['base_fragment_version'])
  if num_fragments > 1:
    raise ValueError('a payload of a num_fragments > 1 run has no '
                     'base_fragment_version')
  return p, int(meta['base_version'])


class Syncer:
  """The syncer's state and loop (see the module doc)."""

  def __init__(self, store: store_lib.Store, params_like: Any,
               options: SyncerOptions, *, init: Any | None = None,
               log=None):
    self.store, self.opts, self.log = store, options.check(), log
    self.params_like = params_like
    self.frags = wire.Fragments(params_like, options.num_fragments)
    self.tx = staleness.staleness_outer(
        _local.nesterov_outer(options.outer_lr, options.outer_momentum),
        age_power=options.age_power, correction=options.correction,
        restart_every=options.restart_every)
    self.direct = direct_leaves(params_like)
    self._update = jax.jit(self.tx.update)
    self._merges = [jax.jit(functools.partial(
        merge_stacked, direct=[self.direct[i] for i in leaves],
        merge=options.merge)) for leaves in self.frags.leaves]
    self.pending: list[_Pending] = []
    self.step_s: dict[str, float] = {}
    self.sync_s = 0.
    self._walls: dict[tuple[str, int], float] = {}
    self._resume(init)
    # per fragment: the previous merge, and the quorum time and deadline of
    # the merge under way
    self.opened = [time.time()] * self.frags.num
    self.quorum_at: dict[int, float] = {}
    self.deadline: dict[int, float] = {}
    self._due: int | None = None

  def _outer_init(self) -> Any:
    """The outer optimizer state: one tree (one fragment) or a tuple of one
    state per fragment, over that fragment's list of leaves."""
    like = jax.tree.map(jnp.asarray, self.params_like)
    if self.frags.num == 1:
      return self.tx.init(like)
    return tuple(self.tx.init(self.frags.take(like, p))
                 for p in range(self.frags.num))

  def _outer(self, p: int) -> Any:
    return self.outer_state if self.frags.num == 1 else self.outer_state[p]

  def _set_outer(self, p: int, state: Any) -> None:
    if self.frags.num == 1:
      self.outer_state = state
    else:
      self.outer_state = (self.outer_state[:p] + (state,)
                          + self.outer_state[p + 1:])

  def _resume(self, init: Any | None) -> None:
    latest = self.store.latest_version()
    outer_like = self._outer_init()
    num = self.frags.num
    if latest is None:
      if init is None:
        raise ValueError(f'store {self.store.root} has no global version and '
                         'no initial parameters were given')
      self.params = jax.tree.map(lambda x: np.asarray(x, np.float32), init)
      self.outer_state = outer_like
      self.version, self.counters = 0, _fresh_counters(num)
      self.counters['syncer_starts'] = 1
      self._publish()
      return
    _, _, meta = self.store.read_global(latest, self.params_like)
    if meta.get('num_fragments', 1) != num:
      raise ValueError(
          f'num_fragments={num}, but the store {self.store.root} was written '
          f'with num_fragments={meta.get("num_fragments", 1)} (global version '
          f'{latest}); restart the syncer with that value')
    params, outer, meta = self.store.read_global(latest, self.params_like,
                                                 outer_like)
    self.params, self.version = params, latest
    self.outer_state = jax.tree.map(jnp.asarray, outer)
    fresh = _fresh_counters(num)
    self.counters = {**fresh, **{k: v for k, v in meta.items() if k in fresh}}
    if 'fragment_versions' not in meta:  # written before fragments existed
      self.counters['fragment_versions'] = [latest]
    self.counters['syncer_starts'] = self.counters.get('syncer_starts', 0) + 1
    self._log('resumed', version=latest)

  def _log(self, event: str, **fields) -> None:
    if self.log is not None:
      self.log.write(json.dumps({'event': event, 'time': time.time(),
                                 **fields}) + '\n')
      self.log.flush()

  def _publish(self, merge: dict[str, Any] | None = None) -> None:
    self.store.publish_global(self.version, self.params, self.outer_state,
                              dict(self.counters, last_merge=merge or {}))

  # --------------------------------------------------------------- poll ---
  def poll(self) -> None:
    """Reads the payloads that arrived since the last poll: every payload
    not consumed yet and not pending (also one older than a payload of
    another fragment that was merged already)."""
    consumed = self.counters['consumed']
    known = {(p.learner, p.seq) for p in self.pending}
    for learner in self.store.learners():
      low = consumed.get(learner, -1)
      done = set(self.counters['consumed_above'].get(learner, ()))
      listed = [n for n in self.store.payload_seqs(learner) if n > low]
      for n in range(low + 1, max(listed, default=low)):
        if n not in done and (learner, n) not in known and n not in listed:
          # deleted by the learner's max_to_keep before this syncer read it
          self.counters['payloads_lost'] += 1
          self._consume(learner, n)
      for seq in listed:
        if seq not in done and (learner, seq) not in known:
          self._read(learner, seq)

  def _read(self, learner: str, seq: int) -> None:
    """Reads payload ``seq`` of ``learner`` into the pending list (or
    consumes it as unusable)."""
    try:
      payload = self.store.read_payload(learner, seq)
      meta = payload.meta
      fragment, base = _payload_fragment(meta, self.frags.num)
      delta = wire.decode(payload.delta, meta.get('codec'),
                          meta.get('seed', 0), self.frags.like[fragment])
    except (store_lib.Gone, ValueError, KeyError) as e:
      self._log('unreadable', learner=learner, seq=seq, error=str(e))
      self._consume(learner, seq)
      self.counters['payloads_unusable'] += 1
      return
    self.pending.append(_Pending(learner, seq, meta, delta, time.time(),
                                 fragment, base))
    if meta.get('step_s'):
      old = self.step_s.get(learner)
      self.step_s[learner] = (meta['step_s'] if old is None
                              else 0.7 * old + 0.3 * meta['step_s'])

  def _consume(self, learner: str, seq: int) -> None:
    """Marks payload ``seq`` of ``learner`` consumed (never read again)."""
    consumed, above = self.counters['consumed'], self.counters[
        'consumed_above']
    done = set(above.get(learner, ())) | {seq}
    low = consumed.get(learner, -1)
    while low + 1 in done:
      low += 1
    consumed[learner] = low
    done = sorted(n for n in done if n > low)
    if done:
      above[learner] = done
    else:
      above.pop(learner, None)

  def age(self, p: _Pending) -> int:
    """Merges of ``p``'s fragment since the version its delta builds on."""
    return self.counters['fragment_versions'][p.fragment] - p.base

  def live_learners(self, now: float) -> set[str]:
    """Learners whose newest payload (by its writer's clock) is recent."""
    live = set()
    for p in self.pending:
      live.add(p.learner)
    for learner in self.store.learners():
      seqs = self.store.payload_seqs(learner)
      if not seqs:
        continue
      key = (learner, seqs[-1])
      if key not in self._walls:
        try:
          self._walls[key] = self.store.read_payload_meta(*key).get('wall', 0)
        except store_lib.Gone:
          continue
      wall = self._walls[key]
      if now - wall <= self.opts.liveness_s:
        live.add(learner)
    return live

  def ready(self, now: float) -> bool:
    """Whether to merge now: some fragment reached its quorum and its grace
    window is over (that fragment is the one :meth:`merge` takes)."""
    self._due = self.due(now)
    return self._due is not None

  def due(self, now: float) -> int | None:
    """The fragment to merge now (of those whose quorum was reached and
    grace window is over, the earliest deadline), or None. Quorum, grace
    window and staleness are per fragment."""
    fresh: dict[int, set[str]] = {}
    for p in self.pending:
      if self.age(p) <= self.opts.max_staleness:
        fresh.setdefault(p.fragment, set()).add(p.learner)
    live, ready = None, []
    for f in sorted(fresh):
      if f not in self.quorum_at:
        if live is None:
          live = len(self.live_learners(now))
        if len(fresh[f]) < min(self.opts.quorum, max(1, live)):
          continue
        self.quorum_at[f] = now
        step = max(self.step_s.values(), default=0.)
        self.deadline[f] = now + grace_window(
            self.opts.grace, self.opts.overlap, step, now - self.opened[f],
            self.sync_s, self.opts.grace_cap_s)
      if now >= self.deadline[f]:
        ready.append((self.deadline[f], f))
    return min(ready)[1] if ready else None

  # -------------------------------------------------------------- merge ---
  def merge(self, fragment: int | None = None) -> dict[str, Any] | None:
    """Merges the pending payloads of ``fragment`` into global version ``v
    + 1`` (None: nothing usable; the stale ones are consumed either way).

    ``fragment`` defaults to the one :meth:`ready` found due, else the
    fragment of the oldest pending payload; the other fragments' payloads
    stay pending."""
    start = time.time()
    if fragment is None:
      fragment = (self._due if self._due is not None else
                  self.pending[0].fragment if self.pending else 0)
    self._due = None
    batch = [p for p in self.pending if p.fragment == fragment]
    self.pending = [p for p in self.pending if p.fragment != fragment]
    use = []
    for p in batch:
      self._consume(p.learner, p.seq)
      self.counters['bytes_received'] += int(p.meta.get('bytes', 0))
      finite = all(np.all(np.isfinite(x)) for x in jax.tree.leaves(p.delta))
      if self.age(p) > self.opts.max_staleness:
        self.counters['payloads_stale'] += 1
        self.counters['tokens_discarded'] += float(p.meta['tokens'])
      elif not finite:
        self.counters['payloads_unusable'] += 1
        self.counters['tokens_discarded'] += float(p.meta['tokens'])
      else:
        use.append(p)
    self.quorum_at.pop(fragment, None)
    self.deadline.pop(fragment, None)
    if not use:
      return None
    weights = self._weights(use)
    ages = np.array([self.age(p) for p in use], np.float32)
    age = float(np.sum(weights * ages) / max(np.sum(weights), 1e-30))
    treedef = jax.tree.structure(self.frags.like[fragment])
    # padded to a power of two with weight-0 entries (which no merge rule
    # counts), so that the merge compiles once per size class, not per M
    pad = (1 << (len(use) - 1).bit_length()) - len(use)
    stacked = [np.concatenate([np.stack(xs),
                               np.zeros((pad,) + xs[0].shape, np.float32)])
               for xs in zip(*[treedef.flatten_up_to(p.delta) for p in use])]
    merged = self._merges[fragment](stacked, jnp.asarray(
        np.concatenate([weights, np.zeros(pad, np.float32)])))
    merged = treedef.unflatten(merged)
    params = self.frags.take(jax.tree.map(jnp.asarray, self.params), fragment)
    updates, outer = self._update(merged, self._outer(fragment), params,
                                  age=jnp.float32(age))
    self._set_outer(fragment, outer)
    self.params = self.frags.put(self.params, fragment, jax.tree.map(
        np.asarray, optax.apply_updates(params, updates)))
    self.version += 1
    c = self.counters
    c['merges'] += 1
    c['fragment_versions'][fragment] += 1
    c['payloads_merged'] += len(use)
    c['tokens_merged'] += float(sum(p.meta['tokens'] for p in use))
    for p in use:
      c['merged_by_learner'][p.learner] = (
          c['merged_by_learner'].get(p.learner, 0) + 1)
    info = {'fragment': fragment,
            'payloads': [[p.learner, p.seq] for p in use],
            'ages': ages.tolist(), 'weights': weights.tolist(), 'age': age}
    self._publish(info)
    self.sync_s = 0.7 * self.sync_s + 0.3 * (time.time() - start)
    self.opened[fragment] = time.time()
    self._log('merge', version=self.version, **info)
    return info

  def _weights(self, use: list[_Pending]) -> np.ndarray:
    if self.opts.weighting == 'uniform':
      return np.array([1. if p.meta['steps'] > 0 else 0. for p in use],
                      np.float32)
    return np.asarray(token_weight(
        np.array([p.meta['tokens'] for p in use], np.float32),
        np.array([p.meta['steps'] for p in use], np.float32)))

  def run(self, *, max_versions: int | None = None,
          max_seconds: float | None = None) -> None:
    """Polls and merges until global version ``max_versions`` is published
    or ``max_seconds`` passed."""
    end = None if max_seconds is None else time.time() + max_seconds
    while max_versions is None or self.version < max_versions:
      if end is not None and time.time() > end:
        break
      self.poll()
      if self.ready(time.time()):
        self.merge()
      else:
        time.sleep(self.opts.poll_s)


def main(config: ml_collections.ConfigDict, store_path: str,
         options: SyncerOptions, *, max_versions: int | None,
         max_seconds: float | None, log_path: str | None) -> None:
  store = store_lib.Store(store_path)
  init = init_params(config)
  log = open(log_path, 'a') if log_path else sys.stdout  # pylint: disable=consider-using-with
  syncer = Syncer(store, init, options, init=init, log=log)
  syncer.run(max_versions=max_versions, max_seconds=max_seconds)
  store.close()


if __name__ == '__main__':
  from loc_opt.train.async_learners import _cli  # pylint: disable=g-import-not-at-top
  _cli.run_syncer(main, SyncerOptions)
