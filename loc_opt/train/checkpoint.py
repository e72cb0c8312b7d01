"""Orbax checkpoints of the whole train state, with exact resume.

The state pytree (every worker's parameters and optimizer state, the outer
copy and outer optimizer state, the step, the RNG and the input position) is
saved with ``orbax.checkpoint.CheckpointManager``, the fields every worker
shares (anchor, outer optimizer state, counters) once
(``loc_opt.train.layout``, which a JSON item ``layout`` describes); a JSON
item beside it keeps the config, so a resume with an incompatible config
fails with a clear error (each differing field as ``leaf.path: saved ->
now``) instead of a shape mismatch deep inside Orbax. Orbax writes each
checkpoint into a temporary directory and renames it when complete, so a
save cut short is never picked by a resume (``loc_opt.train.orbax_io``).

On resume, the model, mesh, method, optimizer, data, batch size, seed and
``num_steps`` must match (:func:`resume_diffs`); run-control fields
(``log_every``, ``eval_every``, ``eval_batches``, ``checkpoint_every``,
``keep_checkpoints``, ``progress``, ``halt_after_steps``, ``init_from``,
``logging``, ``wallclock``, ``data.data_dir``, ``data.eval_batch_size``)
may change.
``num_steps`` may not: the learning-rate and sync schedules are built from
it, so a longer or shorter resumed run would silently re-stretch them
mid-run; to train longer, branch off the run (``init_from``). The ``mesh``
may change for a method whose workers share an anchor (``Method.elastic``):
an elastic resume (``loc_opt.train.elastic``).

Every checkpoint carries a digest of each saved array (``digests``, a JSON
item; ``loc_opt.train.integrity``), computed where each process holds the
bytes and checked against the arrays read back on restore; and a state
with a non-finite leaf (parameters, inner and outer optimizer state,
anchor, codec state, counters) is never saved: :class:`faults.NonFiniteError`
names the leaf.

A newest checkpoint that cannot be read (a truncated or garbage file, a
missing item, a digest that does not match, a state of another structure,
a file that cannot be opened) is reported in one line, with the reason in
words, moved to ``workdir/unreadable_checkpoints`` (or, when it cannot be
moved, left in place, skipped and named), and the run resumes from the
newest readable one; with none left, :class:`CheckpointError` says why for
each.

Rotation keeps the newest ``keep_checkpoints`` checkpoints and, besides
them, the newest *verified* one: the one this run restored (its digests
matched), until a newer one is verified. So a corruption that a save could
not see never costs the last checkpoint known to be good.

A new run may also start from another run's checkpoint (:func:`restore_branch`,
the decay branch of WSD / WSD-S): then the model, mesh, data, batch, seed,
method and optimizer must match, while the learning-rate schedule, the sync
schedule and the run length may change.
"""

from collections.abc import Callable, Sequence
import errno
import json
import logging
import os
import pathlib
import re
import shutil
import sys
import traceback
from typing import Any
import warnings

import jax
from jax.experimental import multihost_utils
import orbax.checkpoint as ocp

from loc_opt.train import faults
from loc_opt.train import integrity
from loc_opt.train import orbax_io
from loc_opt.train import registry

# Config fields that must match for a checkpoint to be resumable (every
# leaf under them), and the leaves under them that may change on resume.
# Every other field (logging cadence and backends, evaluation and checkpoint
# cadence, progress, halt_after_steps, init_from, wallclock) may change on
# resume.
# faults: injected NaNs, dropout and learner failures change the numbers;
# worker speeds drive async local SGD's and Decoupled DiLoCo's numerics.
_MUST_MATCH = ('model', 'mesh', 'outer', 'optimizer', 'batch_size', 'seed',
               'num_steps', 'data', 'faults', 'wallclock.worker_speeds')
# outer.overlap groups steps into programs, with the same numbers.
_RESUME_MAY_DIFFER = ('data.data_dir', 'data.eval_batch_size',
                      'faults.max_bad_steps', 'outer.overlap')

# A branch must continue the same training problem and the same state
# layout: everything under these fields must match, except the fields of
# _BRANCH_MAY_DIFFER. (Numeric optimizer hyperparameters other than the
# learning-rate schedule live in the saved state under
# optax.inject_hyperparams, so a changed value would be silently ignored;
# they must match too.)
_BRANCH_MUST_MATCH = ('model', 'mesh', 'data', 'batch_size', 'seed',
                      'outer', 'optimizer')
_BRANCH_MAY_DIFFER = ('optimizer.learning_rate', 'optimizer.schedule',
                      'optimizer.schedule_kwargs', 'outer.sync_every',
                      'outer.sync_schedule', 'outer.sync_schedule_kwargs',
                      'outer.overlap')


def _get(tree: dict[str, Any], dotted: str) -> Any:
  for key in dotted.split('.'):
    if not isinstance(tree, dict):
      return None
    tree = tree.get(key)
  return tree


def _flatten(tree: Any, prefix: str) -> dict[str, Any]:
  if not isinstance(tree, dict):
    return {prefix: tree}
  out = {}
  for k, v in tree.items():
    out.update(_flatten(v, f'{prefix}.{k}'))
  return out


def config_diffs(saved: dict[str, Any], current: dict[str, Any],
                 must_match: Sequence[str],
                 may_differ: Sequence[str] = ()) -> list[str]:
  """Descriptions of the fields under ``must_match`` that differ.

  Args:
    saved: the saved config (a dict).
    current: the current config (a dict).
    must_match: dotted field names whose whole subtree must match.
    may_differ: dotted field names (or prefixes) exempt from the check.

  Returns:
    ``'field: saved -> now'`` for each differing leaf field.
  """
  exempt = tuple(may_differ)

  def allowed(field):
    return any(field == e or field.startswith(e + '.') for e in exempt)

  diffs = []
  for key in must_match:
    a, b = _flatten(_get(saved, key), key), _flatten(_get(current, key), key)
    for field in sorted(set(a) | set(b)):
      if not allowed(field) and a.get(field) != b.get(field):
        diffs.append(f'{field}: {a.get(field)!r} -> {b.get(field)!r}')
  return diffs


def latest_step(workdir: str | os.PathLike) -> int | None:
  """The latest checkpoint step in ``workdir``, without creating anything."""
  directory = pathlib.Path(workdir).absolute() / 'checkpoints'
  if not directory.is_dir():
    return None
  manager = ocp.CheckpointManager(
      directory, options=ocp.CheckpointManagerOptions(create=False))
  try:
    return manager.latest_step()
  finally:
    manager.close()


class CheckpointError(RuntimeError):
  """A checkpoint in the workdir cannot be used to resume."""


class DiskFullError(CheckpointError):
  """A save found no space left on the workdir's device."""


# TensorStore's status prefixes, as its errors reach Python.
_STATUS = re.compile(r'^([A-Z_]+): ')


def _chain(error: BaseException) -> list[BaseException]:
  out, seen = [], set()
  while error is not None and id(error) not in seen:
    seen.add(id(error))
    out.append(error)
    error = error.__cause__ or error.__context__
  return out


def _first_line(text: str, limit: int = 200) -> str:
  text = re.sub(r'\s*\[tensorstore_spec=.*', '', text.strip(), flags=re.S)
  line = (text.splitlines() or [''])[0]
  return line if len(line) <= limit else line[:limit - 3] + '...'


def unreadable_reason(error: BaseException, where: pathlib.Path) -> str:
  """Why checkpoint ``where`` could not be read, in words (one line):
  which file or array, and what is wrong with it."""
  chain = _chain(error)
  for e in chain:
    if isinstance(e, PermissionError):
      return f'permission denied reading {e.filename or where}'
    if isinstance(e, IsADirectoryError):
      return f'a directory where a file should be: {e.filename}'
    if isinstance(e, OSError) and e.errno == errno.EIO:
      return f'I/O error reading {e.filename or where}'
  texts = [str(e) for e in chain]
  for text in texts:
    m = re.search(r'Item "(\w+)" was not found', text)
    if m:
      return f'item {m.group(1)!r} missing ({where / m.group(1)} is absent)'
  if any('pytree structure error' in t for t in texts) and \
      not (where / 'state' / '_METADATA').exists():
    return f'metadata missing ({where / "state" / "_METADATA"} is absent)'
  status = [t for t in texts if _STATUS.match(t)]
  detail = status[-1] if status else texts[-1]
  array = re.search(r'Error (?:reading|writing) "([^"/]+)(?:/[^"]*)?"', detail)
  name = f' ({array.group(1)})' if array else ''
  if 'byte range' in detail and 'not valid for value of size' in detail:
    return f'an array file is shorter than its metadata says{name}'
  if re.search(r'zstd|decompress|Truncated', detail, re.I):
    return f'array data cannot be decoded{name}: ' + _first_line(
        detail.rsplit(': ', 1)[-1], 120)
  if 'manifest' in detail and 'Error decoding' in detail:
    return 'the array index (OCDBT manifest) cannot be decoded: ' + \
        _first_line(detail.rsplit(': ', 1)[-1], 120)
  if detail.startswith('PERMISSION_DENIED'):
    return f'permission denied{name}: ' + _first_line(detail, 160)
  if detail.startswith('NOT_FOUND'):
    return f'a file is missing{name}: ' + _first_line(detail, 160)
  return f'{type(chain[-1]).__name__}: {_first_line(detail)}'


class _Unreadable(CheckpointError):
  """The checkpoint at ``step`` cannot be read; ``reason`` is one line."""

  def __init__(self, step: int, where: pathlib.Path,
               error: BaseException | None = None, reason: str = ''):
    reason = reason or unreadable_reason(error, where)
    if len(reason) > 300:
      reason = reason[:297] + '...'
    self.step, self.reason = step, reason
    super().__init__(f'checkpoint {where} is unreadable ({reason})')


def _is_closed_loop_callback(unraisable: Any) -> bool:
  """Whether ``unraisable`` is a TensorStore completion callback that found
  Orbax's event loop already closed."""
  exc = unraisable.exc_value
  if not (isinstance(exc, RuntimeError)
          and str(exc) == 'Event loop is closed'):
    return False
  frames = traceback.extract_tb(unraisable.exc_traceback)
  return bool(frames) and frames[0].name == 'call_soon_threadsafe'


def _drop_orbax_unretrieved(record: logging.LogRecord) -> bool:
  """False for asyncio's report of an Orbax / TensorStore read whose
  failure nobody retrieved (the gather had already raised the first one)."""
  message = record.getMessage()
  return not (message.startswith(('Task exception was never retrieved',
                                  'Future exception was never retrieved'))
              and ('/orbax/checkpoint/' in message
                   or 'tensorstore_spec' in message))


def _quiet_orbax_restore_failures() -> None:
  """Silences the side effects of a failed Orbax restore, nothing else.

  Orbax reads every array concurrently (``asyncio.gather`` of TensorStore
  reads in a fresh event loop, ``orbax.checkpoint._src.asyncio_utils``).
  When one read fails, the gather raises, Orbax closes the loop, and each
  read still in flight later completes on a TensorStore thread whose
  callback calls ``loop.call_soon_threadsafe`` on the closed loop: Python
  prints each such ``RuntimeError: Event loop is closed`` through
  ``sys.unraisablehook``; the other reads that failed too are logged by
  asyncio as "Task / Future exception was never retrieved" when collected,
  and the never-awaited metadata coroutine comes as a ``RuntimeWarning``.
  All are harmless (the results are discarded) and would bury the real
  error, so these filters drop exactly those and pass everything else on.
  Installed once per process.
  """
  if getattr(sys.unraisablehook, '_loc_opt_filter', False):
    return
  previous = sys.unraisablehook

  def hook(unraisable):
    if not _is_closed_loop_callback(unraisable):
      previous(unraisable)

  hook._loc_opt_filter = True  # pylint: disable=protected-access
  sys.unraisablehook = hook
  logging.getLogger('asyncio').addFilter(_drop_orbax_unretrieved)
  warnings.filterwarnings(
      'ignore', message=r"coroutine '[\w.]+_get_array_metadatas' was never "
      'awaited', category=RuntimeWarning)


def _drop_orbax_disk_full(record: logging.LogRecord) -> bool:
  """False for Orbax's log of a write thread that failed on a full disk
  (with its traceback): :meth:`Checkpointer.save` reports it in one line."""
  message = record.getMessage()
  return not ('raised an exception' in message
              and 'No space left on device' in message)


def _quiet_orbax_disk_full() -> None:
  """Installs :func:`_drop_orbax_disk_full` on absl's logger, once."""
  logger = logging.getLogger('absl')
  if _drop_orbax_disk_full not in logger.filters:
    logger.addFilter(_drop_orbax_disk_full)


def _stderr_line(text: str) -> None:
  print(text, file=sys.stderr, flush=True)


def _stdout_line(text: str) -> None:
  if jax.process_index() == 0:
    print(text, flush=True)


class Checkpointer:
  """Saves and restores train states under ``workdir/checkpoints``.

  ``layout`` (a ``loc_opt.train.layout.StateLayout``) is how saves store the
  state (shared fields once); without it the tree is saved as it is.
  ``warn`` gets the one-line reports of unreadable checkpoints (default:
  standard error), ``report`` the line of an elastic resume (default:
  standard output of process 0).
  """

  def __init__(self, workdir: str | os.PathLike, *, every: int,
               max_to_keep: int = 2, read_only: bool = False,
               layout: Any = None,
               warn: Callable[[str], None] = _stderr_line,
               report: Callable[[str], None] = _stdout_line):
    self.dir = pathlib.Path(workdir).absolute() / 'checkpoints'
    self.every = every
    self.layout = layout
    self.warn, self.report = warn, report
    if read_only and not self.dir.is_dir():
      raise CheckpointError(f'no checkpoints in {self.dir}')
    _quiet_orbax_disk_full()
    # Rotation is ours (_rotate: the newest verified one is kept too);
    # read-only: nothing is created or deleted.
    self.max_to_keep = max_to_keep
    self.manager = ocp.CheckpointManager(
        self.dir,
        options=ocp.CheckpointManagerOptions(
            max_to_keep=None, create=not read_only,
            enable_async_checkpointing=False),
        item_handlers=orbax_io.item_handlers())
    self.read_only = read_only
    # Steps whose arrays were read back and matched their digests.
    self.verified: set[int] = set()
    # Unreadable steps that could not be moved aside (skipped, named).
    self.stuck: set[int] = set()
    self._checked = False  # whether the last restore matched digests

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def all_steps(self) -> list[int]:
    return sorted(self.manager.all_steps())

  def should_save(self, step: int, last_step: int) -> bool:
    return step == last_step or (self.every > 0 and step % self.every == 0)

  def save(self, step: int, state: Any, config_json: str) -> None:
    """Saves ``state`` as checkpoint ``step`` (nothing if it exists).

    Raises:
      faults.NonFiniteError: a leaf of the state is not finite (named);
        nothing is written.
      DiskFullError: the device of the workdir is full; the partial
        checkpoint is removed, the earlier ones are intact.
    """
    if self.read_only:
      raise CheckpointError(f'{self.dir} was opened read-only')
    if step in self.manager.all_steps():
      if step in self.stuck:
        self.warn(f'not saving step {step}: the unreadable checkpoint '
                  f'{self.dir / str(step)} could not be moved aside')
      return
    items = {'config': ocp.args.JsonSave(json.loads(config_json))}
    if self.layout is not None:
      state = self.layout.to_saved(state)
      items['layout'] = ocp.args.JsonSave(self.layout.info)
    digests, finite = integrity.inspect(state)
    bad = integrity.first_non_finite(finite)
    if bad is not None:
      raise faults.NonFiniteError(
          f'non-finite values in {bad} at step {step}; not saving a '
          'checkpoint, the previous one is finite')
    items['digests'] = ocp.args.JsonSave(
        {'algorithm': integrity.ALGORITHM, 'arrays': digests})
    items['state'] = ocp.args.StandardSave(state)
    try:
      self.manager.save(step, args=ocp.args.Composite(**items), force=True)
      self.manager.wait_until_finished()
    except Exception as e:  # pylint: disable=broad-except
      if not any(isinstance(x, OSError) and x.errno == errno.ENOSPC
                 or 'No space left on device' in str(x) for x in _chain(e)):
        raise
      self._remove_partial(step)
      raise DiskFullError(self._disk_full_message(step)) from None
    self._rotate()

  def _remove_partial(self, step: int) -> None:
    """Removes what a failed save of ``step`` left (Orbax's temporary
    directory, or an unfinished step directory)."""
    if jax.process_index() != 0:
      return
    for path in self.dir.glob(f'{step}.orbax-checkpoint-tmp*'):
      shutil.rmtree(path, ignore_errors=True)
    final = self.dir / str(step)
    if final.is_dir() and not (final / 'commit_success.txt').exists() \
        and not (final / '_CHECKPOINT_METADATA').exists():
      shutil.rmtree(final, ignore_errors=True)

  def _disk_full_message(self, step: int) -> str:
    need = None
    for s in sorted(self.manager.all_steps(), reverse=True):
      try:
        need = sum(f.stat().st_size for f in (self.dir / str(s)).rglob('*')
                   if f.is_file())
        break
      except OSError:
        continue
    free = shutil.disk_usage(self.dir).free
    size = (f'about {need:,} bytes (the size of the last checkpoint)'
            if need else 'more space')
    return (f'no space left on the device of {self.dir.parent} while saving '
            f'the checkpoint of step {step}: it needs {size}, {free:,} bytes '
            'are free; its partial copy was removed and the earlier '
            'checkpoints are intact. Free space and run the same command '
            'to resume.')

  def _rotate(self) -> None:
    """Deletes all but the newest ``max_to_keep`` checkpoints and the
    newest verified one."""
    if not self.max_to_keep:
      return
    steps = sorted(self.manager.all_steps(), reverse=True)
    keep = set(steps[:self.max_to_keep])
    verified = [s for s in steps if s in self.verified]
    if verified:
      keep.add(verified[0])
    for s in steps:
      if s in keep or s in self.stuck:
        continue
      try:
        self.manager.delete(s)
      except Exception as e:  # pylint: disable=broad-except
        self.stuck.add(s)
        self.warn(f'could not delete the old checkpoint {self.dir / str(s)} '
                  f'({_first_line(str(e))}); it stays')

  def restore(self, target: Any, config_json: str,
               step: int | None = None, *,
               compare: Callable[[dict, dict], list[str]] | None = None,
               ) -> tuple[int, Any]:
    """Restores ``step`` (default: the newest readable one).

    Without ``step``, a checkpoint that cannot be read (a truncated or
    garbage file, a missing item, a state of another structure) is skipped
    for the next older one; once one is restored, each skipped one is
    reported in one line (``warn``) and moved to
    ``workdir/unreadable_checkpoints``, so that new saves replace it.

    Args:
      target: the run's ``loc_opt.train.layout.StateLayout`` (a checkpoint
        of shared fields stored once, or of another worker count: an
        elastic resume), or a tree of ``jax.ShapeDtypeStruct`` leaves with
        shardings, restored as it is.
      config_json: the current config, compared with the saved one.
      step: which checkpoint; the newest readable one by default.
      compare: ``(saved, current) -> differences`` that forbid the restore
        (default: :func:`resume_diffs`).

    Returns:
      ``(step, state)``.

    Raises:
      CheckpointError: if the saved config differs in a field that must
        match (a config difference never falls back), or no checkpoint
        (``step`` itself, if given) can be read.
    """
    _quiet_orbax_restore_failures()
    if step is not None:
      if step not in self.manager.all_steps():
        raise CheckpointError(f'no checkpoint at step {step} in {self.dir}; '
                              f'saved steps: {self.all_steps()}')
      return step, self._restore_step(target, config_json, step, compare)
    steps = sorted(self.manager.all_steps(), reverse=True)
    if not steps:
      raise CheckpointError(f'no checkpoint in {self.dir}')
    unreadable = []
    for s in steps:
      try:
        state = self._restore_step(target, config_json, s, compare)
      except _Unreadable as e:
        unreadable.append(e)
        continue
      for e in unreadable:
        moved, why = self._set_aside(e.step)
        if moved:
          where = f' (moved it to {moved})'
        elif why:
          where = (f' (could not move it aside: {why}; skipped, it stays at '
                   f'{self.dir / str(e.step)})')
        else:
          where = ''
        self.warn(f'checkpoint at step {e.step} is unreadable ({e.reason}); '
                  f'resuming from step {s}{where}')
      if self._checked:
        self.verified.add(s)
      return s, state
    raise CheckpointError(
        f'no readable checkpoint in {self.dir}: '
        + '; '.join(str(e) for e in unreadable)
        + '. Move them aside to start afresh, or use a new workdir')

  def _restore_step(self, target, config_json, step, compare):
    """The state at ``step``; ``_Unreadable`` if it cannot be read."""
    where = self.dir / str(step)
    try:
      saved = self.manager.restore(
          step, args=ocp.args.Composite(config=ocp.args.JsonRestore()))
      saved_config = saved['config']
    except Exception as e:  # pylint: disable=broad-except
      raise _Unreadable(step, where, e) from e
    compare = resume_diffs if compare is None else compare
    diffs = compare(saved_config, json.loads(config_json))
    if diffs:
      raise CheckpointError(
          f'checkpoint {where} was written with a different config: '
          f'{"; ".join(diffs)}. Use a new --workdir, or restore the original '
          'config.')
    layout = target if hasattr(target, 'abstract_saved') else None
    try:
      info = self._layout_info(step) if layout is not None else None
    except Exception as e:  # pylint: disable=broad-except
      raise _Unreadable(step, where, e) from e
    if info is not None:  # a layout this run cannot read is no corruption
      try:
        layout.check(info)
      except ValueError as e:
        raise CheckpointError(f'checkpoint {where}: {e}') from None
    workers = _get(saved_config, 'mesh.workers')
    if layout is not None and info is None and workers != layout.workers:
      raise CheckpointError(
          f'checkpoint {where} stores the whole state of each worker (it '
          'predates the layout that stores shared fields once), so it can '
          f'only resume with its own mesh.workers={workers}')
    try:
      abstract = target if layout is None else layout.abstract_saved(info)
      restored = self.manager.restore(
          step, args=ocp.args.Composite(
              state=ocp.args.StandardRestore(abstract)))
    except Exception as e:  # pylint: disable=broad-except
      raise _Unreadable(step, where, e) from e
    self._verify(step, where, restored['state'])
    if layout is None:
      return restored['state']
    state, note = layout.from_saved(restored['state'], info, step)
    if note:
      self.report(note)
    return state

  def _verify(self, step: int, where: pathlib.Path, saved_tree: Any) -> None:
    """Checks the arrays read back against the digests saved with them
    (a checkpoint written before digests, or with digests of another
    kind, has none to check: then it does not count as verified)."""
    self._checked = False
    if not (where / 'digests').exists():
      return
    try:
      saved = self.manager.restore(
          step, args=ocp.args.Composite(digests=ocp.args.JsonRestore()))
      saved = saved['digests']
      algorithm, saved = saved.get('algorithm'), saved['arrays']
    except Exception as e:  # pylint: disable=broad-except
      raise _Unreadable(step, where, e) from e
    if algorithm != integrity.ALGORITHM:
      return  # digests of another kind (another version): not checkable
    now, _ = integrity.inspect(saved_tree)
    bad = integrity.mismatches(saved, now)
    if bad:
      more = f' and {len(bad) - 1} more' if len(bad) > 1 else ''
      raise _Unreadable(step, where, reason=(
          f'checksum mismatch in {bad[0]}{more}: the bytes read back differ '
          'from those saved (a file changed after it was written)'))
    self._checked = True

  def _layout_info(self, step: int) -> dict[str, Any] | None:
    """The ``layout`` item of checkpoint ``step`` (None: it has none, the
    state was saved whole)."""
    if not (self.dir / str(step) / 'layout').exists():
      return None
    return self.manager.restore(
        step, args=ocp.args.Composite(layout=ocp.args.JsonRestore()))['layout']

  def _set_aside(self, step: int) -> tuple[pathlib.Path | None, str]:
    """Moves checkpoint ``step`` out of the way of new saves to
    ``workdir/unreadable_checkpoints`` (process 0 moves it).

    Returns:
      ``(where it went, '')``, or ``(None, why)`` when it could not be
      moved (then it stays, is never deleted or overwritten by this run,
      and a save of its step is skipped with a line), or ``(None, '')``
      read-only.
    """
    if self.read_only:
      return None, ''
    dest = self.dir.parent / 'unreadable_checkpoints' / str(step)
    why = ''
    if jax.process_index() == 0:
      try:
        n = 1
        while dest.exists():
          dest, n = dest.with_name(f'{step}.{n}'), n + 1
        dest.parent.mkdir(exist_ok=True)
        os.rename(self.dir / str(step), dest)
      except OSError as e:
        why = f'{e.strerror or type(e).__name__}: {e.filename or dest}'
    if jax.process_count() > 1:  # every process sees it gone before saving
      failed = multihost_utils.broadcast_one_to_all(int(bool(why)))
      if int(failed) and not why:
        why = 'process 0 could not move it'
    self.manager.reload()
    if why:
      self.stuck.add(step)
      return None, why
    return dest, ''

  def close(self) -> None:
    self.manager.close()


def abstract_with_shardings(tree: Any, shardings: Any) -> Any:
  """``ShapeDtypeStruct`` leaves carrying the given shardings."""
  return jax.tree.map(
      lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
      tree, shardings)


def _mesh_reason(method_name: str) -> str:
  """Why ``method_name`` cannot resume on another mesh."""
  method = registry.METHODS.get(method_name)
  if method is not None and not method.per_worker:
    return (f'outer.method={method_name!r} keeps one replicated copy of the '
            'state and does not support an elastic resume')
  return (f'outer.method={method_name!r} has no anchor shared by all '
          'workers to start new workers from (Method.elastic), so it cannot '
          'resume with another mesh; elastic: '
          f'{", ".join(n for n, m in registry.METHODS.items() if m.elastic)}')


# Fields added after runs were saved, with the value that reproduces how
# those runs behaved without them: a saved config that lacks one resumes
# when the current value is that one.
_ADDED_WITH_OLD_BEHAVIOUR = {
    'faults.chaos_chips_per_learner': 1,
    'outer.aggregate': 'mean',  # the plain mean; trim and clip unused
    'outer.aggregate_trim': 1, 'outer.aggregate_clip': 1.0,
    'outer.state_layout': 'replicated', 'mesh.simulate_workers': False,
}

# The faults fields only a method with a timeline (Method.step_inputs)
# reads; the others refuse any value but the default (validate_config).
_TIMELINE_FAULTS = ('faults.failures', 'faults.chaos_')


def _unread_prefixes(method_name: str) -> tuple[str, ...]:
  """Config fields that ``method_name``'s run never reads: the other
  methods' sections ``outer.<section>`` and, without a timeline, the
  learner-failure fields. A difference there (e.g. a field added to
  another method's section since the run was saved) cannot change it."""
  method = registry.METHODS.get(method_name)
  own = getattr(method, 'section', None)
  out = tuple(f'outer.{m.section}.' for m in registry.METHODS.values()
              if m.section is not None and m.section != own)
  if method is not None and method.step_inputs is None:
    out += _TIMELINE_FAULTS
  return out


def resume_diffs(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
  """The differences that forbid resuming a run saved with ``saved``.

  ``num_steps`` is among them: the learning-rate (and sync) schedules are
  built from it, so a resume with another value would silently re-stretch
  them mid-run. To train longer, branch off the run with ``init_from``.

  Fields the run's method never reads (other methods' sections; the
  learner-failure fields without a timeline) may differ.

  ``outer.state_layout`` may switch between ``'replicated'`` and
  ``'offloaded'`` (the checkpoint is the same), not to or from
  ``'sharded'``.

  The ``mesh`` fields (``mesh.workers``, and the axes inside a worker) may
  differ when the method's workers share an anchor (``Method.elastic``): an
  elastic resume (``loc_opt.train.elastic``); for the other methods the
  difference says why not.
  """
  method = _get(current, 'outer.method')
  elastic = getattr(registry.METHODS.get(method), 'elastic', False)
  may_differ = _RESUME_MAY_DIFFER + (('mesh',) if elastic else ())
  added = tuple(f'{k}: None -> {v!r}'
                for k, v in _ADDED_WITH_OLD_BEHAVIOUR.items())
  diffs = [d for d in config_diffs(saved, current, _MUST_MATCH, may_differ)
           if not d.startswith(_unread_prefixes(method)) and d not in added]
  # The replicated and the offloaded outer state are stored alike (the
  # placement is the run's): a run may switch between them on resume.
  whole = ('replicated', 'offloaded')
  if all((_get(c, 'outer.state_layout') or 'replicated') in whole
         for c in (saved, current)):
    diffs = [d for d in diffs if not d.startswith('outer.state_layout:')]
  out = []
  for d in diffs:
    if d.startswith('num_steps:'):
      d += (' (the schedules are built for num_steps; to train longer, '
            'start a new workdir with init_from)')
    elif d.startswith('mesh.'):
      d += f' ({_mesh_reason(method)})'
    out.append(d)
  return out


def check_resume(workdir: str | os.PathLike, config_json: str) -> None:
  """Checks, from the saved config alone, that a run may resume from
  ``workdir``'s newest checkpoint whose config can be read (nothing is
  compiled or restored; nothing happens without a checkpoint).

  Raises:
    CheckpointError: naming each differing field (:func:`resume_diffs`).
  """
  if latest_step(workdir) is None:
    return
  ckpt = Checkpointer(workdir, every=0, read_only=True)
  try:
    for step in sorted(ckpt.manager.all_steps(), reverse=True):
      try:
        saved = ckpt.manager.restore(
            step, args=ocp.args.Composite(config=ocp.args.JsonRestore()))
      except Exception:  # pylint: disable=broad-except
        continue  # reported by Checkpointer.restore
      diffs = resume_diffs(saved['config'], json.loads(config_json))
      if diffs:
        raise CheckpointError(
            f'checkpoint {ckpt.dir / str(step)} was written with a different '
            f'config: {"; ".join(diffs)}. Use a new --workdir, or restore the '
            'original config.')
      return
  finally:
    ckpt.close()


def _branch_diffs(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
  return config_diffs(saved, current, _BRANCH_MUST_MATCH, _BRANCH_MAY_DIFFER)


def _open_branch_source(from_workdir, step) -> 'Checkpointer':
  source = pathlib.Path(from_workdir)
  if not (source.absolute() / 'checkpoints').is_dir():
    raise CheckpointError(f'init_from.workdir={str(from_workdir)!r} has no '
                          'checkpoints directory')
  ckpt = Checkpointer(source, every=0, read_only=True)
  if step not in ckpt.all_steps():
    steps = ckpt.all_steps()
    ckpt.close()
    raise CheckpointError(
        f'init_from.step={step}: {ckpt.dir} has no checkpoint at that step; '
        f'saved steps: {steps}')
  return ckpt


def check_branch(from_workdir: str | os.PathLike, step: int,
                 config_json: str) -> None:
  """Checks, from the saved config alone, that a run may branch off
  ``from_workdir`` at ``step`` (see :func:`restore_branch`).

  Raises:
    CheckpointError: naming the missing checkpoint or the differing fields.
  """
  ckpt = _open_branch_source(from_workdir, step)
  try:
    try:
      saved = ckpt.manager.restore(
          step, args=ocp.args.Composite(config=ocp.args.JsonRestore()))
    except Exception as e:  # pylint: disable=broad-except
      raise CheckpointError(
          f'checkpoint {ckpt.dir / str(step)} is unreadable '
          f'({type(e).__name__}: {e})') from e
    diffs = _branch_diffs(saved['config'], json.loads(config_json))
    if diffs:
      raise CheckpointError(
          f'cannot branch from init_from.workdir={str(from_workdir)!r} at '
          f'step {step}: it was trained with a different config ('
          f'{"; ".join(diffs)}). A branch may change only '
          f'{", ".join(_BRANCH_MAY_DIFFER)} and run-control fields.')
  finally:
    ckpt.close()


def restore_branch(from_workdir: str | os.PathLike, step: int,
                   target: Any, config_json: str) -> tuple[int, Any]:
  """Restores another run's state at ``step`` to start a branch from it.

  Everything is restored: parameters, optimizer state (with its count, so
  the branch's schedule continues in the main run's numbering), the step,
  the RNG and the input position.

  Args:
    from_workdir: the main run's workdir.
    step: the checkpoint step to branch from.
    target: the branch's ``StateLayout`` (the state must have the main
      run's layout), or its abstract state (see ``Checkpointer.restore``).
    config_json: the branch's config.

  Returns:
    ``(step, state)``.

  Raises:
    CheckpointError: if there is no such checkpoint, if the model, mesh,
      data, batch, seed, method or optimizer differ (only the learning-rate
      schedule, the sync schedule and run-control fields may), or if the
      saved state does not fit the branch's layout.
  """
  check_branch(from_workdir, step, config_json)
  ckpt = _open_branch_source(from_workdir, step)
  try:
    return ckpt.restore(target, config_json, step,
                        compare=_branch_diffs)
  finally:
    ckpt.close()
