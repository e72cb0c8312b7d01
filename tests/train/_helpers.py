"""Helpers shared by the trainer tests: a tiny config, array leaves, and
waiting for a launched run's steps."""

import os
import signal
import subprocess
import time

import jax
import numpy as np

from configs import diloco_lm
from loc_opt.train import config as cfg_lib
from loc_opt.train.method import shared_mask


def tiny_config(data_dir, base=diloco_lm, *, model='mlp',
                config_schedule=False, **overrides):
  """The default config (or the config module ``base``'s) shrunk to a tiny
  byte-level LM on short sequences (H = 4), at a constant learning rate
  unless ``config_schedule`` keeps the config's schedule; ``overrides`` maps
  dotted fields to values.

  ``model``: ``'mlp'`` (the default), a 2-layer MLP bigram model of 4
  parameter leaves, or ``'transformer'``, a 1-block Transformer of 11. The
  trainer's methods, faults, checkpoints and layouts work on any pytree, and
  XLA compiles the MLP's steps in about 40% of the Transformer's time (most
  of the suite is compiles); tests of the Transformer's own sharding (tensor
  parallelism, FSDP, scanned blocks) and runs compared with its launches use
  ``'transformer'``.
  """
  c = base.get_config(model)  # the config argument picks the model
  c.num_steps = 12
  c.batch_size = 16
  c.data.eval_batch_size = 16
  c.eval_batches = 1
  c.eval_every = 6
  c.log_every = 2
  c.checkpoint_every = 4
  c.progress = False
  if model == 'mlp':
    c.model.hidden = 64
  else:
    c.model.d_model = 32
    c.model.num_heads = 2
    c.model.num_layers = 1
    c.model.d_ff = 64
    c.model.max_len = 32
  c.data.seq_len = 32
  c.data.max_bytes = 300_000
  c.data.data_dir = data_dir
  c.outer.sync_every = 4
  # A constant learning rate: a schedule's step counts (warmup, decay) are
  # constants of the compiled step, so under warmup-cosine every num_steps
  # compiles programs of its own; with this, runs of any length share them
  # (the suite's compilation cache). Tests of schedules, and runs compared
  # with a launch of the config file, keep the config's schedule.
  if not config_schedule:
    c.optimizer.schedule = 'constant'
    c.optimizer.schedule_kwargs = {}
  return cfg_lib.with_overrides(c, overrides)


def leaves(tree):
  """The leaves of ``tree`` as NumPy arrays."""
  return [np.asarray(x) for x in jax.tree.leaves(tree)]


def assert_leaves_close(a, b, rtol=1e-5, atol=1e-6):
  """``a``'s and ``b``'s leaves equal to float32 rounding: for two runs that
  compute the same in two different XLA programs (another layout, mesh or
  code path), whose reductions may sum in another order on another CPU.
  Integer and boolean leaves (counts, steps, masks) must be equal."""
  a, b = leaves(a), leaves(b)
  assert len(a) == len(b), (len(a), len(b))
  for x, y in zip(a, b, strict=True):
    assert x.shape == y.shape and x.dtype == y.dtype, (x.shape, y.shape)
    if jax.numpy.issubdtype(x.dtype, jax.numpy.floating):
      np.testing.assert_allclose(y.astype(np.float32), x.astype(np.float32),
                                 rtol=rtol, atol=atol)
    else:
      np.testing.assert_array_equal(y, x)


# A NaN gradient on worker 1 at steps 0 and 1 (skipped on that worker where
# it is an inner step): the shared fields must stay level regardless.
NAN_ON_WORKER_1 = {'faults.nan_grad_steps': (0, 1),
                   'faults.nan_grad_workers': (1,)}


def assert_shared_fields_level(method, state):
  """Every shared field of ``state['opt_state']`` (``method.shared_fields``)
  is bit-identical on every worker, while the workers' own floating state
  did diverge (so the check bites), after a run with
  :data:`NAN_ON_WORKER_1`."""
  opt_state = state['opt_state']
  mask = jax.tree.leaves(shared_mask(method, opt_state))
  values = jax.tree.leaves(opt_state)
  shared = [np.asarray(x) for x, s in zip(values, mask, strict=True) if s]
  assert shared, method
  # The same operations on every worker, of one program, on level inputs
  # (exact by design: a shared field is stored once): bit-identical.
  for x in shared:
    for m in range(1, x.shape[0]):
      np.testing.assert_array_equal(x[m], x[0])
  per_worker = [np.asarray(x) for x, s in zip(values, mask, strict=True)
                if not s and np.issubdtype(np.asarray(x).dtype, np.floating)]
  assert any(not np.array_equal(x[1], x[0]) for x in per_worker), method
  assert int(state['faults']['bad_steps'][1]) == 2


def wait_for_steps(proc, metrics, n: int, timeout: float) -> None:
  """Waits until the run ``proc`` (a ``subprocess.Popen``) has written
  ``n`` records to ``metrics`` (its ``metrics.jsonl``); fails if it ends
  first or ``timeout`` seconds pass."""
  deadline = time.monotonic() + timeout
  while time.monotonic() < deadline:
    if proc.poll() is not None:
      raise AssertionError(f'the run ended early: {proc.communicate()}')
    if metrics.exists() and len(metrics.read_text().splitlines()) >= n:
      return
    time.sleep(0.02)
  raise AssertionError(f'no {n} steps after {timeout}s')


def preempt_after_steps(cmd, cwd, env, workdir, n: int, timeout: float):
  """Starts the run ``cmd`` (its own process group), sends it SIGTERM once
  it has logged ``n`` steps to ``workdir/metrics.jsonl`` (see
  :func:`wait_for_steps`) and waits for it to end; kills the group if it
  does not. Returns ``(returncode, stdout, stderr)``."""
  proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True,
                          start_new_session=True)
  try:
    wait_for_steps(proc, workdir / 'metrics.jsonl', n, timeout)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
  finally:
    if proc.poll() is None:
      os.killpg(proc.pid, signal.SIGKILL)
      proc.communicate()
  return proc.returncode, out, err
