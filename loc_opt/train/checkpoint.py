"""Orbax checkpoints of the whole train state, with exact resume.

The state pytree (every worker's parameters and optimizer state, the outer
copy and outer optimizer state, the step, the RNG and the input position) is
saved with ``orbax.checkpoint.CheckpointManager``; a JSON item beside it keeps
the config, so a resume with an incompatible config fails with a clear error
instead of a shape mismatch deep inside Orbax. Orbax writes each checkpoint
into a temporary directory and renames it when complete, so an interrupted
save never leaves a half-written checkpoint that a resume would pick.
"""

import json
import os
import pathlib
from typing import Any

import jax
import orbax.checkpoint as ocp

# Config fields that must match for a checkpoint to be resumable.
_MUST_MATCH = ('model', 'mesh', 'outer', 'optimizer', 'batch_size', 'seed')


class CheckpointError(RuntimeError):
  """A checkpoint in the workdir cannot be used to resume."""


class Checkpointer:
  """Saves and restores train states under ``workdir/checkpoints``."""

  def __init__(self, workdir: str | os.PathLike, *, every: int,
               max_to_keep: int = 2):
    self.dir = pathlib.Path(workdir).absolute() / 'checkpoints'
    self.every = every
    self.manager = ocp.CheckpointManager(
        self.dir,
        options=ocp.CheckpointManagerOptions(
            max_to_keep=max_to_keep, create=True,
            enable_async_checkpointing=False),
    )

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def should_save(self, step: int, last_step: int) -> bool:
    return step == last_step or (self.every > 0 and step % self.every == 0)

  def save(self, step: int, state: Any, config_json: str) -> None:
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
              step: int | None = None) -> tuple[int, Any]:
    """Restores ``step`` (default latest) into ``abstract_state``'s layout.

    Args:
      abstract_state: ``jax.ShapeDtypeStruct`` leaves with shardings.
      config_json: the current config, compared with the saved one.
      step: which checkpoint; the latest by default.

    Returns:
      ``(step, state)``.

    Raises:
      CheckpointError: if the saved config differs in a field that changes
        the state's layout, or the checkpoint cannot be read.
    """
    step = self.latest_step() if step is None else step
    if step is None:
      raise CheckpointError(f'no checkpoint in {self.dir}')
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
    diffs = [k for k in _MUST_MATCH if saved_config.get(k) != current.get(k)]
    if diffs:
      detail = '; '.join(
          f'{k}: saved {saved_config.get(k)!r} vs now {current.get(k)!r}'
          for k in diffs)
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
