r"""One asynchronous learner: an ordinary training loop that trades
pseudo-gradients for merged models through the store.

::

  python -m loc_opt.train.async_learners.learner \
      --config=configs/diloco_lm.py:mlp --store=/shared/run1 \
      --learner=a --index=0 --num_learners=4

Each round it trains ``H = config.outer.sync_every`` inner steps (the
trainer's model, data and inner optimizer: ``loc_opt.models.build_model``,
``loc_opt.train.experiment.load_data``, ``loc_opt.train.config.make_inner``)
from where it stands, publishes the pseudo-gradient of the round ``Delta =
theta_start - theta_end`` (optionally through a codec, with error feedback,
bytes counted) with its base version (the global version it last took),
tokens and steps, then takes the newest global version if there is a newer
one (overwriting its parameters: Decoupled DiLoCo's ``alpha = 0``) and goes
on; it never waits for the syncer or for other learners. If there is no
newer version it continues from its own parameters, and its next delta is
again the one round's progress, so nothing is sent twice.

**Fragments.** With ``num_fragments = P > 1`` (the syncer's value, which
the store records; another value is refused at the start) a round is ``H /
P`` inner steps and publishes one fragment (:class:`.wire.Fragments`: whole
tensors bin-packed as the SPMD Decoupled DiLoCo splits them), fragment
``p`` after the inner steps ``t`` with ``t mod H = p H / P``: every
fragment every ``H`` steps, staggered. Its payload holds that fragment's
leaves only, ``Delta_p = theta_p(last publish or take of p) - theta_p``,
with the fragment's base (the version of fragment ``p`` it builds on) and
the tokens and steps since fragment ``p`` was last published or taken (the
counters restart then, as in the SPMD version). A newer global version
overwrites only the fragments merged since the learner last took them
(their fragment versions grew; ``alpha = 0``, or with ``alpha > 0``
Streaming DiLoCo's mixing ``alpha theta_q + (1 - alpha) Theta_q``, as the
SPMD version's ``alpha``, the next delta still measured from ``Theta_q``);
the others keep its own progress. ``P = 1``: the whole model every ``H`` steps, as above.

Learner ``index`` of ``num_learners`` reads its own shard of the trainer's
batches (worker ``index`` of ``config.mesh.workers = num_learners``), at the
position of its own inner-step count.

**Rejoin.** A learner started on a store that has global versions (a restart
after a crash, or one added mid-run) starts from the newest version; its
payload numbers continue after the last one it wrote. After each round it
publishes its inner state (inner optimizer state and step count, with the
base version the round started from) to the store, an atomic versioned
Orbax step of its own (the newest ``Store.keep_states`` kept). On a start
its inner state and step count are:

* ``rejoin_state='keep'``: its own newest published one, else fresh;
* ``'fresh'``: fresh (the optimizer's init, step 0);
* ``'peer'``: a live peer's newest one (the Decoupled DiLoCo rejoin: pull
  the optimizer state from a healthy peer learner): of the other learners
  whose newest inner state was written within ``peer_liveness_s`` seconds,
  the one on the highest base version, then the most recent
  (:meth:`Store.newest_peer_state`). With no live peer (or its state
  deleted before it was read) it falls back to its own, then fresh. Taking
  the peer's step count moves the learner's inner learning-rate schedule
  and its data position (its own shard, at that step) to the peer's.

One JSON line (event ``inner_state``) says which was taken: ``source`` is
``peer``, ``own`` or ``fresh``, with the peer's id and state number.

**Several processes.** A learner may be one process or several joined by
their own ``jax.distributed`` (:mod:`._procs`): its mesh spans their
devices, its rows are split over them, parameters and inner state are
replicated. Process 0 alone writes (payloads, inner states): it holds a
full copy of every replicated value, so it writes host NumPy arrays
through the same single-writer Orbax managers as a one-process learner,
one write per payload, and the store's layout does not depend on how many
processes a learner has (Orbax's multi-process save would need every
process in the save, each writing its shards, for no gain on replicated
values). Every process reads the global versions itself; the version to
take is decided by process 0 and broadcast.
"""

import functools
import json
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
from loc_opt.train import config as cfg_lib
from loc_opt.train import experiment
from loc_opt.train import hosts
from loc_opt.train import programs
from loc_opt.train.async_learners import _procs
from loc_opt.train.async_learners import store as store_lib
from loc_opt.train.async_learners import wire

REJOIN_STATES = ('keep', 'fresh', 'peer')
_NEXT = {'keep': ('own',), 'fresh': (), 'peer': ('peer', 'own')}


def _wait_for_version(store: store_lib.Store, timeout_s: float) -> int:
  end = time.time() + timeout_s
  while True:
    v = store.latest_version()
    if v is not None:
      return v
    if time.time() > end:
      raise TimeoutError(f'no global version in {store.root} after '
                         f'{timeout_s} s: is the syncer running?')
    time.sleep(0.1)


class Learner:
  """One learner's loop (see the module doc).

  Args:
    config: a trainer config (``configs/diloco_lm.py``); ``num_steps`` is
      the inner learning-rate schedule's length and the learner's budget.
    store: the store.
    learner: this learner's id (a directory name).
    index, num_learners: its data shard.
    codec: a codec name for the payload (None: float32).
    rejoin_state: ``'keep'``, ``'fresh'`` or ``'peer'`` (the module doc).
    slowdown_s: seconds slept after each inner step (a slower learner).
    peer_liveness_s: with ``'peer'``, how recent a peer's newest inner
      state must be for the peer to count as live.
    num_fragments: ``P`` (see the module doc); must be the syncer's.
    alpha: weight of its own copy when a merged fragment arrives (0:
      overwrite, Decoupled DiLoCo's default).
  """

  def __init__(self, config: ml_collections.ConfigDict,
               store: store_lib.Store, learner: str, *, index: int = 0,
               num_learners: int = 1, codec: str | None = None,
               rejoin_state: str = 'keep', slowdown_s: float = 0.,
               log=None, wait_s: float = 120., peer_liveness_s: float = 60.,
               num_fragments: int = 1, alpha: float = 0.):
    store_lib.check_learner_id(learner)
    _checks.one_of(rejoin_state, 'rejoin_state', REJOIN_STATES)
    if not 0 <= index < num_learners:
      raise ValueError(f'index {index} is not in [0, num_learners = '
                       f'{num_learners})')
    if config.batch_size % num_learners:
      raise ValueError(f'batch_size {config.batch_size} is not divisible by '
                       f'num_learners {num_learners}')
    self.config = ml_collections.ConfigDict(config.to_dict())
    self.config.mesh.workers = num_learners
    self.store, self.id, self.index = store, learner, index
    self.codec, self.slowdown_s, self.log = codec, slowdown_s, log
    self.rows = config.batch_size // num_learners
    self.model = models.build_model(config.model)
    self.inner = cfg_lib.make_inner(self.config)
    self.data = experiment.load_data(self.config)
    self.params_like = jax.eval_shape(self.model.init, jax.random.key(0))
    self.H = cfg_lib.sync_every(self.config)
    self.frags = wire.Fragments(self.params_like, num_fragments)
    self.alpha = _checks.in_interval(alpha, 'alpha', 0, 1)
    self.stride = self.frags.stride(self.H)  # steps per round: H / P
    self.mesh, self.writer = _procs.mesh(), hosts.is_writer()
    if self.rows % self.mesh.devices.size:
      raise ValueError(f'a learner\'s {self.rows} rows (batch_size / '
                       'num_learners) do not split over its '
                       f'{self.mesh.devices.size} devices')
    rep = jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec())
    self._rows_sharding = jax.sharding.NamedSharding(
        self.mesh, jax.sharding.PartitionSpec('data'))
    self._step = jax.jit(functools.partial(_train_step, self.model,
                                           self.inner), out_shardings=rep)
    self.params = None
    while self.params is None:
      latest = _wait_for_version(store, wait_s) if self.writer else 0
      self._take(int(_procs.agree([latest])[0]))
    self.inner_state = jax.jit(self.inner.init, out_shardings=rep)(
        self.params)
    self.step = 0
    source = self._rejoin(rejoin_state, peer_liveness_s)
    # per fragment: where its next delta starts (its values at its last
    # publish or take), the step count then, the codec's error feedback
    self.anchor, self.since = self.params, [self.step] * self.frags.num
    self.errors = [None] * self.frags.num
    seqs = store.payload_seqs(learner) if self.writer else []
    self.seq = int(_procs.agree([seqs[-1] + 1 if seqs else 0])[0])
    self.rejoined = self.seq > 0 or source == 'own'
    self._log('start', version=self.version, step=self.step, seq=self.seq,
              rejoined=self.rejoined, processes=jax.process_count())

  def _take(self, version: int) -> bool:
    """Every process reads global ``version`` into ``self.params``; False
    (nothing changed) if it was deleted meanwhile on any of them."""
    try:
      params, _, meta = self.store.read_global(version, self.params_like)
      ok = True
    except store_lib.Gone:
      params, meta, ok = None, {}, False
    if not _procs.all_true(ok):
      return False
    if meta.get('num_fragments', 1) != self.frags.num:
      raise ValueError(
          f'learner {self.id}: num_fragments={self.frags.num}, but the '
          f'syncer of {self.store.root} runs with num_fragments='
          f'{meta.get("num_fragments", 1)} (global version {version}); '
          'start the learner with that value')
    params = _procs.replicated(params, self.mesh)
    versions = meta.get('fragment_versions', [version])
    if self.params is None:  # the start: the whole model
      self.params, self.fragment_versions = params, list(versions)
      self.took = list(range(self.frags.num))
    else:  # the fragments merged since this learner last took them
      self.took = [q for q in range(self.frags.num)
                   if versions[q] > self.fragment_versions[q]]
      for q in self.took:
        part = self.frags.take(params, q)
        mine = part if not self.alpha else jax.tree.map(
            lambda m, g: self.alpha * m + (1 - self.alpha) * g,
            self.frags.take(self.params, q), part)
        self.params = self.frags.put(self.params, q, mine)
        self.anchor = self.frags.put(self.anchor, q, part)
        self.since[q], self.fragment_versions[q] = self.step, versions[q]
    self.version = version
    return True

  def _newest(self) -> int | None:
    """The newest global version, as process 0 sees it."""
    newest = self.store.latest_version() if self.writer else None
    newest = int(_procs.agree([-1 if newest is None else newest])[0])
    return None if newest < 0 else newest

  def _rejoin(self, how: str, liveness_s: float) -> str:
    """Sets the inner state and step count per ``how`` (see the module
    doc); returns where they came from: ``peer``, ``own`` or ``fresh``."""
    got, source = None, 'fresh'
    for source in _NEXT[how]:
      got = self._inner_from(source, liveness_s)
      if got is not None:
        break
    if got is None:
      source, who, seq = 'fresh', None, None
    else:
      who, seq, state = got
      self.inner_state = _procs.replicated(state['inner'], self.mesh)
      self.step = int(state['step'])
    self._log('inner_state', requested=how, source=source, source_learner=who,
              source_seq=seq, step=self.step,
              moment=_moment(jax.tree.map(hosts.fetch, self.inner_state)))
    return source

  def _inner_from(self, source: str, liveness_s: float
                  ) -> tuple[str, int, Any] | None:
    """``(learner, seq, state)`` of the inner state to take from ``source``
    (``'peer'`` or ``'own'``), or None when there is none (or it was deleted
    before every process read it)."""
    who, seq = '', -1
    if self.writer and source == 'peer':
      meta = self.store.newest_peer_state(self.id, now=time.time(),
                                          liveness_s=liveness_s)
      if meta is not None:
        who, seq = meta['learner'], meta['seq']
    elif self.writer:
      seqs = self.store.learner_state_seqs(self.id)
      who, seq = self.id, (seqs[-1] if seqs else -1)
    who, seq = _procs.agree_text(who), int(_procs.agree([seq])[0])
    if seq < 0:
      return None
    like = {'inner': jax.eval_shape(self.inner.init, self.params_like),
            'step': np.int64(0)}
    try:
      got = self.store.read_learner_state(who, like, seq)
    except store_lib.Gone:
      got = None
    if not _procs.all_true(got is not None):
      return None
    return who, seq, got[1]

  def _log(self, event: str, *, every_process: bool = True, **fields) -> None:
    """A JSON line; from every process (with its ``process`` index when
    there are several) or, with ``every_process=False``, process 0's."""
    if self.log is None or not (every_process or self.writer):
      return
    if jax.process_count() > 1:
      fields['process'] = jax.process_index()
    self.log.write(json.dumps({'event': event, 'learner': self.id,
                               'time': time.time(), **fields}) + '\n')
    self.log.flush()

  def batch(self, step: int) -> jax.Array:
    """Step ``step``'s rows of this learner's shard, split over its
    processes (each reads only its own rows)."""
    lo = self.index * self.rows
    return hosts.global_batch(
        self._rows_sharding, (self.rows, self.config.data.seq_len + 1),
        lambda block: self.data.train.rows(
            step, lo + block[0].start, lo + block[0].stop)[:, block[1]])

  def _publish_state(self, base_version: int) -> None:
    """Publishes the inner state after payload ``self.seq`` (process 0
    writes; every process computes its moment, a checksum)."""
    state = {'inner': jax.tree.map(hosts.fetch, self.inner_state),
             'step': np.int64(self.step)}
    moment = _moment(state['inner'])
    if self.writer:
      self.store.save_learner_state(self.id, self.seq, state, {
          'base_version': base_version, 'step': self.step,
          'wall': time.time(), 'moment': moment})
    self._log('inner', every_process=False, seq=self.seq, step=self.step,
              base_version=base_version, moment=moment)

  def round(self) -> dict[str, Any]:
    """Trains ``H / P`` steps, publishes the fragment that comes due (the
    whole model with ``P = 1``), takes the fragments merged since."""
    t0 = time.time()
    loss = jnp.zeros([])
    for _ in range(self.stride):
      self.params, self.inner_state, loss = self._step(
          self.params, self.inner_state, self.batch(self.step))
      self.step += 1
      if self.slowdown_s:
        time.sleep(self.slowdown_s)
    p = self.frags.due(self.step, self.H)
    end = self.frags.take(self.params, p)
    delta = jax.tree.map(
        lambda a, b: np.asarray(hosts.fetch(a - b), np.float32),
        self.frags.take(self.anchor, p), end)
    if self.errors[p] is not None:  # error feedback of the codec
      delta = jax.tree.map(np.add, delta, self.errors[p])
    stored, nbytes, decoded = wire.encode(delta, self.codec,
                                          seed=self.seq)
    if self.codec not in (None, '', 'none'):
      self.errors[p] = jax.tree.map(np.subtract, delta, decoded)
    step_s = (time.time() - t0) / self.stride
    steps = self.step - self.since[p]
    tokens = steps * self.rows * self.config.data.seq_len
    meta = {'base_version': self.version, 'tokens': tokens, 'steps': steps,
            'step_s': step_s, 'bytes': nbytes, 'codec': self.codec,
            'seed': self.seq, 'loss': float(loss), 'wall': time.time(),
            'inner_steps': self.step, 'fragment': p,
            'base_fragment_version': self.fragment_versions[p]}
    self.anchor = self.frags.put(self.anchor, p, end)
    self.since[p] = self.step
    if self.writer:  # one write per payload (see the module doc)
      self.store.publish_payload(self.id, self.seq, stored, meta)
    self._publish_state(meta['base_version'])
    self._log('payload', every_process=False, seq=self.seq, **meta)
    self.seq += 1
    newest = self._newest()
    # a version deleted meanwhile is not taken: the next round takes a newer
    if newest is not None and newest > self.version and self._take(newest):
      self._log('took', version=newest, fragments=self.took, moment=_moment(
          jax.tree.map(hosts.fetch, self.params)))
    return meta

  def run(self, *, max_rounds: int | None = None,
          stop_at_version: int | None = None) -> None:
    """Rounds until ``max_rounds``, the step budget ``config.num_steps``,
    or a global version ``>= stop_at_version``."""
    rounds = 0
    while self.step + self.stride <= self.config.num_steps:
      if max_rounds is not None and rounds >= max_rounds:
        break
      if stop_at_version is not None:
        newest = self._newest()
        if newest is not None and newest >= stop_at_version:
          break
      self.round()
      rounds += 1


def _moment(tree: Any) -> float:
  """A checksum of a tree of host arrays: the sum of its floating leaves'
  sums, in float64 (equal for equal trees, on every process)."""
  return float(sum(np.sum(np.asarray(x, np.float64))
                   for x in jax.tree.leaves(tree)
                   if np.issubdtype(np.asarray(x).dtype, np.floating)))


def _train_step(model, inner, params, inner_state, batch):
  loss, grads = jax.value_and_grad(
      lambda p: programs.train_loss_fn(model, p, batch))(params)
  updates, inner_state = inner.update(grads, inner_state, params)
  return optax.apply_updates(params, updates), inner_state, loss


def main(config: ml_collections.ConfigDict, store_path: str, learner: str,
         **kwargs) -> None:
  run_kwargs = {k: kwargs.pop(k) for k in ('max_rounds', 'stop_at_version')}
  store = store_lib.Store(store_path)
  Learner(config, store, learner, log=sys.stdout, **kwargs).run(**run_kwargs)
  store.close()


if __name__ == '__main__':
  from loc_opt.train.async_learners import _cli  # pylint: disable=g-import-not-at-top
  _cli.run_learner(main, REJOIN_STATES)
