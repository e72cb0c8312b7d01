"""Orbax checkpoints of the whole train state, with exact resume.

The state pytree (every worker's parameters and optimizer state, the outer
copy and outer optimizer state, the step, the RNG and the input position) is
saved with ``orbax.checkpoint.CheckpointManager``; a JSON item beside it keeps
the config, so a resume with an incompatible config fails with a clear error
instead of a shape mismatch deep inside Orbax. Orbax writes each checkpoint
into a temporary directory and renames it when complete, so an interrupted
save never leaves a half-written checkpoint that a resume would pick.

A new run may also start from another run's checkpoint (:func:`restore_branch`,
the decay branch of WSD / WSD-S): then the model, mesh, data, batch, seed,
method and optimizer must match, while the learning-rate schedule, the sync
schedule and the run length may change.
"""

from collections.abc import Callable, Sequence
import json
import os
import pathlib
from typing import Any

import jax
import orbax.checkpoint as ocp

# Config fields that must match for a checkpoint to be resumable.
_MUST_MATCH = ('model', 'mesh', 'outer', 'optimizer', 'batch_size', 'seed')

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
                      'outer.sync_schedule', 'outer.sync_schedule_kwargs')


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
    ``'field: saved X vs now Y'`` for each differing leaf field.
  """
  exempt = tuple(may_differ)

  def allowed(field):
    return any(field == e or field.startswith(e + '.') for e in exempt)

  diffs = []
  for key in must_match:
    a, b = _flatten(_get(saved, key), key), _flatten(_get(current, key), key)
    for field in sorted(set(a) | set(b)):
      if not allowed(field) and a.get(field) != b.get(field):
        diffs.append(f'{field}: saved {a.get(field)!r} vs now '
                     f'{b.get(field)!r}')
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


class Checkpointer:
  """Saves and restores train states under ``workdir/checkpoints``."""

  def __init__(self, workdir: str | os.PathLike, *, every: int,
               max_to_keep: int = 2, read_only: bool = False):
    self.dir = pathlib.Path(workdir).absolute() / 'checkpoints'
    self.every = every
    if read_only and not self.dir.is_dir():
      raise CheckpointError(f'no checkpoints in {self.dir}')
    # Read-only: nothing is created, and nothing is ever deleted since
    # nothing is saved (max_to_keep applies on save only).
    self.manager = ocp.CheckpointManager(
        self.dir,
        options=ocp.CheckpointManagerOptions(
            max_to_keep=None if read_only else max_to_keep,
            create=not read_only, enable_async_checkpointing=False),
    )
    self.read_only = read_only

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def all_steps(self) -> list[int]:
    return sorted(self.manager.all_steps())

  def should_save(self, step: int, last_step: int) -> bool:
    return step == last_step or (self.every > 0 and step % self.every == 0)

  def save(self, step: int, state: Any, config_json: str) -> None:
    if self.read_only:
      raise CheckpointError(f'{self.dir} was opened read-only')
    if step in self.manager.all_steps():
      return
    self.manager.save(
        step,
        args=ocp.args.Composite(
            state=ocp.args.StandardSave(state),
            config=ocp.args.JsonSave(json.loads(config_json)),
        ),
        force=True,
    )
    self.manager.wait_until_finished()

  def restore(self, abstract_state: Any, config_json: str,
              step: int | None = None, *,
              compare: Callable[[dict, dict], list[str]] | None = None,
              ) -> tuple[int, Any]:
    """Restores ``step`` (default latest) into ``abstract_state``'s layout.

    Args:
      abstract_state: ``jax.ShapeDtypeStruct`` leaves with shardings.
      config_json: the current config, compared with the saved one.
      step: which checkpoint; the latest by default.
      compare: ``(saved, current) -> differences`` that forbid the restore
        (default: any difference under the resume fields).

    Returns:
      ``(step, state)``.

    Raises:
      CheckpointError: if the saved config differs in a field that changes
        the state's layout, or the checkpoint cannot be read.
    """
    step = self.latest_step() if step is None else step
    if step is None:
      raise CheckpointError(f'no checkpoint in {self.dir}')
    if step not in self.manager.all_steps():
      raise CheckpointError(f'no checkpoint at step {step} in {self.dir}; '
                            f'saved steps: {self.all_steps()}')
    where = self.dir / str(step)
    try:
      saved = self.manager.restore(
          step, args=ocp.args.Composite(config=ocp.args.JsonRestore()))
      saved_config = saved['config']
    except Exception as e:  # pylint: disable=broad-except
      raise CheckpointError(
          f'checkpoint {where} is unreadable ({type(e).__name__}: {e}); '
          'move it aside to resume from an earlier one, or use a new '
          'workdir') from e
    current = json.loads(config_json)
    if compare is None:
      diffs = [k for k in _MUST_MATCH
               if saved_config.get(k) != current.get(k)]
      detail = '; '.join(
          f'{k}: saved {saved_config.get(k)!r} vs now {current.get(k)!r}'
          for k in diffs)
    else:
      diffs = compare(saved_config, current)
      detail = '; '.join(diffs)
    if diffs:
      raise CheckpointError(
          f'checkpoint {where} was written with a different config ({detail}). '
          'Use a new --workdir, or restore the original config.')
    try:
      restored = self.manager.restore(
          step, args=ocp.args.Composite(
              state=ocp.args.StandardRestore(abstract_state)))
    except Exception as e:  # pylint: disable=broad-except
      raise CheckpointError(
          f'checkpoint {where} could not be restored ({type(e).__name__}: '
          f'{e}); it may be corrupt: move it aside to resume from an earlier '
          'one, or use a new workdir') from e
    return step, restored['state']

  def close(self) -> None:
    self.manager.close()


def abstract_with_shardings(tree: Any, shardings: Any) -> Any:
  """``ShapeDtypeStruct`` leaves carrying the given shardings."""
  return jax.tree.map(
      lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
      tree, shardings)


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
                   abstract_state: Any, config_json: str) -> tuple[int, Any]:
  """Restores another run's state at ``step`` to start a branch from it.

  Everything is restored: parameters, optimizer state (with its count, so
  the branch's schedule continues in the main run's numbering), the step,
  the RNG and the input position.

  Args:
    from_workdir: the main run's workdir.
    step: the checkpoint step to branch from.
    abstract_state: the branch's state layout (must equal the main run's).
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
    return ckpt.restore(abstract_state, config_json, step,
                        compare=_branch_diffs)
  finally:
    ckpt.close()
