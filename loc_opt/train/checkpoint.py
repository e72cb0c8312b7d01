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

from collections.abc import Callable
import errno
import json
import os
import pathlib
import sys
from typing import Any

import jax
from jax.experimental import multihost_utils
import orbax.checkpoint as ocp

from loc_opt.train import checkpoint_faults as cf
from loc_opt.train import faults
from loc_opt.train import integrity
from loc_opt.train import orbax_io
from loc_opt.train import preemption
from loc_opt.train.resume_rules import BRANCH_MAY_DIFFER
from loc_opt.train.resume_rules import branch_diffs
from loc_opt.train.resume_rules import config_diffs  # pylint: disable=unused-import  (re-exported)
from loc_opt.train.resume_rules import get_field
from loc_opt.train.resume_rules import resume_diffs

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


class _Unreadable(CheckpointError):
  """The checkpoint at ``step`` cannot be read; ``reason`` is one line."""

  def __init__(self, step: int, where: pathlib.Path,
               error: BaseException | None = None, reason: str = ''):
    reason = reason or cf.unreadable_reason(error, where)
    if len(reason) > 300:
      reason = reason[:297] + '...'
    self.step, self.reason = step, reason
    super().__init__(f'checkpoint {where} is unreadable ({reason})')


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
    cf.quiet_orbax_disk_full()
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
                 or 'No space left on device' in str(x) for x in cf.chain(e)):
        raise
      cf.remove_partial(self.dir, step)
      raise DiskFullError(cf.disk_full_message(
          self.dir, self.manager.all_steps(), step)) from None
    self._rotate()

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
                  f'({cf.first_line(str(e))}); it stays')

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
    cf.quiet_orbax_restore_failures()
    if step is not None:
      if step not in self.manager.all_steps():
        raise CheckpointError(f'no checkpoint at step {step} in {self.dir}; '
                              f'saved steps: {self.all_steps()}')
      return step, self._read(target, config_json, step, compare)
    steps = sorted(self.manager.all_steps(), reverse=True)
    if not steps:
      raise CheckpointError(f'no checkpoint in {self.dir}')
    unreadable = []
    for s in steps:
      try:
        state = self._read(target, config_json, s, compare)
      except _Unreadable as e:
        lost = cf.lost_peer(e)
        if lost:  # not the checkpoint's fault: keep it, fall back to none
          raise CheckpointError(
              f'restoring {e.step} in {self.dir} stopped: another process '
              f'of the run left ({lost}); the checkpoint is kept') from e
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

  def _read(self, target, config_json, step, compare):
    """:meth:`_restore_step`; a startup signal that cut the read stops the
    run (Orbax re-raises the :class:`preemption.Interrupted` it was cut by
    inside its own error, which is no fault of the checkpoint)."""
    try:
      return self._restore_step(target, config_json, step, compare)
    except _Unreadable as e:
      stop = preemption.startup_interruption()
      if stop is not None:
        raise stop from e
      raise

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
    workers = get_field(saved_config, 'mesh.workers')
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
    diffs = branch_diffs(saved['config'], json.loads(config_json))
    if diffs:
      raise CheckpointError(
          f'cannot branch from init_from.workdir={str(from_workdir)!r} at '
          f'step {step}: it was trained with a different config ('
          f'{"; ".join(diffs)}). A branch may change only '
          f'{", ".join(BRANCH_MAY_DIFFER)} and run-control fields.')
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
                        compare=branch_diffs)
  finally:
    ckpt.close()
