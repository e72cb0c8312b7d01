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

Learner ``index`` of ``num_learners`` reads its own shard of the trainer's
batches (worker ``index`` of ``config.mesh.workers = num_learners``), at the
position of its own inner-step count.

**Rejoin.** A learner started on a store that has global versions (a restart
after a crash, or one added mid-run) starts from the newest version. Its
inner optimizer state and step count are its own last saved ones
(``rejoin_state='keep'``, saved after each round) or fresh
(``'fresh'``); its payload numbers continue after the last one it wrote.
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
from loc_opt.train import programs
from loc_opt.train.async_learners import store as store_lib
from loc_opt.train.async_learners import wire

REJOIN_STATES = ('keep', 'fresh')


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
    rejoin_state: ``'keep'`` or ``'fresh'`` (see the module doc).
    slowdown_s: seconds slept after each inner step (a slower learner).
  """

  def __init__(self, config: ml_collections.ConfigDict,
               store: store_lib.Store, learner: str, *, index: int = 0,
               num_learners: int = 1, codec: str | None = None,
               rejoin_state: str = 'keep', slowdown_s: float = 0.,
               log=None, wait_s: float = 120.):
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
    self._step = jax.jit(functools.partial(_train_step, self.model,
                                           self.inner))
    self.version = _wait_for_version(store, wait_s)
    self.params = self._read(self.version)
    self.inner_state = self.inner.init(self.params)
    self.step, self.error = 0, None
    saved = (store.read_learner_state(learner, self._own_like())
             if rejoin_state == 'keep' else None)
    if saved is not None:
      own = saved[1]
      self.inner_state = jax.tree.map(jnp.asarray, own['inner'])
      self.step = int(own['step'])
    seqs = store.payload_seqs(learner)
    self.seq = seqs[-1] + 1 if seqs else 0
    self.rejoined = bool(seqs) or saved is not None
    self._log('start', version=self.version, step=self.step, seq=self.seq,
              rejoined=self.rejoined)

  def _own_like(self) -> dict[str, Any]:
    return {'inner': self.inner.init(self.params), 'step': np.int64(0)}

  def _read(self, version: int) -> Any:
    params, _, _ = self.store.read_global(version, self.params_like)
    return jax.tree.map(jnp.asarray, params)

  def _log(self, event: str, **fields) -> None:
    if self.log is not None:
      self.log.write(json.dumps({'event': event, 'learner': self.id,
                                 'time': time.time(), **fields}) + '\n')
      self.log.flush()

  def batch(self, step: int) -> jax.Array:
    lo = self.index * self.rows
    return jnp.asarray(self.data.train.rows(step, lo, lo + self.rows))

  def round(self) -> dict[str, Any]:
    """Trains ``H`` steps, publishes the payload, takes a newer version."""
    start, t0 = self.params, time.time()
    loss = jnp.zeros([])
    for _ in range(self.H):
      self.params, self.inner_state, loss = self._step(
          self.params, self.inner_state, self.batch(self.step))
      self.step += 1
      if self.slowdown_s:
        time.sleep(self.slowdown_s)
    delta = jax.tree.map(lambda a, b: np.asarray(a - b, np.float32), start,
                         self.params)
    if self.error is not None:  # error feedback of the codec
      delta = jax.tree.map(np.add, delta, self.error)
    stored, nbytes, decoded = wire.encode(delta, self.codec,
                                          seed=self.seq)
    if self.codec not in (None, '', 'none'):
      self.error = jax.tree.map(np.subtract, delta, decoded)
    step_s = (time.time() - t0) / self.H
    tokens = self.H * self.rows * self.config.data.seq_len
    meta = {'base_version': self.version, 'tokens': tokens, 'steps': self.H,
            'step_s': step_s, 'bytes': nbytes, 'codec': self.codec,
            'seed': self.seq, 'loss': float(loss), 'wall': time.time(),
            'inner_steps': self.step}
    self.store.publish_payload(self.id, self.seq, stored, meta)
    self.store.save_learner_state(self.id, self.seq, {
        'inner': self.inner_state, 'step': np.int64(self.step)})
    self._log('payload', seq=self.seq, **meta)
    self.seq += 1
    newest = self.store.latest_version()
    if newest is not None and newest > self.version:
      try:
        self.params = self._read(newest)
        self.version = newest
        self._log('took', version=newest)
      except store_lib.Gone:
        pass  # deleted meanwhile: the next round takes a newer one
    return meta

  def run(self, *, max_rounds: int | None = None,
          stop_at_version: int | None = None) -> None:
    """Rounds until ``max_rounds``, the step budget ``config.num_steps``,
    or a global version ``>= stop_at_version``."""
    rounds = 0
    while self.step + self.H <= self.config.num_steps:
      if max_rounds is not None and rounds >= max_rounds:
        break
      if stop_at_version is not None:
        newest = self.store.latest_version()
        if newest is not None and newest >= stop_at_version:
          break
      self.round()
      rounds += 1


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
