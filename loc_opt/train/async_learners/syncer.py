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

Choice: the whole model is one fragment (every payload carries every
parameter); Decoupled DiLoCo's staggered fragments are in the SPMD version
(:func:`loc_opt.outer.decoupled_diloco`).
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

  def check(self) -> 'SyncerOptions':
    if not isinstance(self.quorum, int) or self.quorum < 1:
      raise ValueError(f'quorum must be an int >= 1, got {self.quorum!r}')
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


def _fresh_counters() -> dict[str, Any]:
  return {'merges': 0, 'payloads_merged': 0, 'payloads_stale': 0,
          'payloads_unusable': 0, 'payloads_lost': 0, 'tokens_merged': 0.,
          'tokens_discarded': 0.,
          'bytes_received': 0, 'consumed': {}, 'merged_by_learner': {},
          'syncer_starts': 0}


class Syncer:
  """The syncer's state and loop (see the module doc)."""

  def __init__(self, store: store_lib.Store, params_like: Any,
               options: SyncerOptions, *, init: Any | None = None,
               log=None):
    self.store, self.opts, self.log = store, options.check(), log
    self.params_like = params_like
    self.tx = staleness.staleness_outer(
        _local.nesterov_outer(options.outer_lr, options.outer_momentum),
        age_power=options.age_power, correction=options.correction,
        restart_every=options.restart_every)
    self.direct = direct_leaves(params_like)
    self._update = jax.jit(self.tx.update)
    self._merge = jax.jit(functools.partial(
        merge_stacked, direct=self.direct, merge=options.merge))
    self.pending: list[_Pending] = []
    self.step_s: dict[str, float] = {}
    self.sync_s = 0.
    self._walls: dict[tuple[str, int], float] = {}
    self._resume(init)
    self.opened = time.time()
    self.quorum_at: float | None = None
    self.deadline: float | None = None

  def _resume(self, init: Any | None) -> None:
    latest = self.store.latest_version()
    outer_like = self.tx.init(jax.tree.map(jnp.asarray, self.params_like))
    if latest is None:
      if init is None:
        raise ValueError(f'store {self.store.root} has no global version and '
                         'no initial parameters were given')
      self.params = jax.tree.map(lambda x: np.asarray(x, np.float32), init)
      self.outer_state = outer_like
      self.version, self.counters = 0, _fresh_counters()
      self.counters['syncer_starts'] = 1
      self._publish()
      return
    params, outer, meta = self.store.read_global(latest, self.params_like,
                                                 outer_like)
    self.params, self.version = params, latest
    self.outer_state = jax.tree.map(jnp.asarray, outer)
    fresh = _fresh_counters()
    self.counters = {**fresh, **{k: v for k, v in meta.items() if k in fresh}}
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
    """Reads the payloads that arrived since the last poll."""
    seen = dict(self.counters['consumed'])
    for p in self.pending:
      seen[p.learner] = max(seen.get(p.learner, -1), p.seq)
    for learner, seq in list(self.store.new_payloads(seen)):
      if seq > seen.get(learner, -1) + 1:
        # deleted by the learner's max_to_keep before this syncer read them
        self.counters['payloads_lost'] += seq - seen.get(learner, -1) - 1
      seen[learner] = seq
      try:
        payload = self.store.read_payload(learner, seq)
        meta = payload.meta
        delta = wire.decode(payload.delta, meta.get('codec'),
                            meta.get('seed', 0), self.params_like)
      except (store_lib.Gone, ValueError) as e:
        self._log('unreadable', learner=learner, seq=seq, error=str(e))
        self._consume(learner, seq)
        self.counters['payloads_unusable'] += 1
        continue
      self.pending.append(_Pending(learner, seq, meta, delta, time.time()))
      if meta.get('step_s'):
        old = self.step_s.get(learner)
        self.step_s[learner] = (meta['step_s'] if old is None
                                else 0.7 * old + 0.3 * meta['step_s'])

  def _consume(self, learner: str, seq: int) -> None:
    consumed = self.counters['consumed']
    consumed[learner] = max(consumed.get(learner, -1), seq)

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
    """Whether to merge now (quorum reached and the grace window over)."""
    fresh = {p.learner for p in self.pending
             if self.version - p.meta['base_version'] <= self.opts.max_staleness}
    if not fresh:
      return False
    if self.quorum_at is None:
      need = min(self.opts.quorum, max(1, len(self.live_learners(now))))
      if len(fresh) < need:
        return False
      self.quorum_at = now
      step = max(self.step_s.values(), default=0.)
      self.deadline = now + grace_window(
          self.opts.grace, self.opts.overlap, step, now - self.opened,
          self.sync_s, self.opts.grace_cap_s)
    return now >= self.deadline

  # -------------------------------------------------------------- merge ---
  def merge(self) -> dict[str, Any] | None:
    """Merges the pending payloads into global version ``v + 1`` (None:
    nothing usable; the stale ones are consumed either way)."""
    start = time.time()
    batch, self.pending = self.pending, []
    use = []
    for p in batch:
      self._consume(p.learner, p.seq)
      self.counters['bytes_received'] += int(p.meta.get('bytes', 0))
      finite = all(np.all(np.isfinite(x)) for x in jax.tree.leaves(p.delta))
      if self.version - p.meta['base_version'] > self.opts.max_staleness:
        self.counters['payloads_stale'] += 1
        self.counters['tokens_discarded'] += float(p.meta['tokens'])
      elif not finite:
        self.counters['payloads_unusable'] += 1
        self.counters['tokens_discarded'] += float(p.meta['tokens'])
      else:
        use.append(p)
    self.quorum_at = self.deadline = None
    if not use:
      return None
    weights = self._weights(use)
    ages = np.array([self.version - p.meta['base_version'] for p in use],
                    np.float32)
    age = float(np.sum(weights * ages) / max(np.sum(weights), 1e-30))
    treedef = jax.tree.structure(self.params_like)
    # padded to a power of two with weight-0 entries (which no merge rule
    # counts), so that the merge compiles once per size class, not per M
    pad = (1 << (len(use) - 1).bit_length()) - len(use)
    stacked = [np.concatenate([np.stack(xs),
                               np.zeros((pad,) + xs[0].shape, np.float32)])
               for xs in zip(*[treedef.flatten_up_to(p.delta) for p in use])]
    merged = self._merge(stacked, jnp.asarray(
        np.concatenate([weights, np.zeros(pad, np.float32)])))
    merged = treedef.unflatten(merged)
    params = jax.tree.map(jnp.asarray, self.params)
    updates, self.outer_state = self._update(merged, self.outer_state, params,
                                             age=jnp.float32(age))
    self.params = jax.tree.map(np.asarray,
                               optax.apply_updates(params, updates))
    self.version += 1
    c = self.counters
    c['merges'] += 1
    c['payloads_merged'] += len(use)
    c['tokens_merged'] += float(sum(p.meta['tokens'] for p in use))
    for p in use:
      c['merged_by_learner'][p.learner] = (
          c['merged_by_learner'].get(p.learner, 0) + 1)
    info = {'payloads': [[p.learner, p.seq] for p in use],
            'ages': ages.tolist(), 'weights': weights.tolist(), 'age': age}
    self._publish(info)
    self.sync_s = 0.7 * self.sync_s + 0.3 * (time.time() - start)
    self.opened = time.time()
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
