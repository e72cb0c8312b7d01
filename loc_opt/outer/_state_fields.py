"""Fields of optimizer states, found by name through chains and wrappers.

DES-LOC and MT-DAO average named fields of the inner optimizer's state
(``mu``, ``nu``, ``slow``) wherever they sit: inside ``optax.chain``,
``inject_hyperparams`` or ``masked`` states, every NamedTuple with a field
of that name holds one.
"""

from collections.abc import Callable, Sequence
from typing import Any

import jax


def _is_owner(name: str) -> Callable[[Any], bool]:
  """Whether a node is a NamedTuple with a field ``name``."""
  def check(node):
    return (isinstance(node, tuple) and hasattr(node, '_fields')
            and name in node._fields)
  return check


def map_state_field(state: Any, name: str, fn: Callable[[Any], Any]) -> Any:
  """Replaces field ``name`` of every NamedTuple in ``state`` by ``fn(it)``.

  Args:
    state: an optimizer state tree (chains, ``inject_hyperparams`` and
      ``masked`` states are searched through).
    name: a NamedTuple field name, e.g. ``'mu'``.
    fn: ``subtree -> subtree``.

  Returns:
    The state with each such field mapped.
  """
  owner = _is_owner(name)

  def leaf(node):
    if owner(node):
      return node._replace(**{name: fn(getattr(node, name))})
    return node

  return jax.tree.map(leaf, state, is_leaf=owner)


def find_state_field(state: Any, name: str) -> list[Any]:
  """The subtrees stored under field ``name`` of NamedTuples in ``state``."""
  owner = _is_owner(name)
  nodes = jax.tree.leaves(state, is_leaf=owner)
  return [getattr(node, name) for node in nodes if owner(node)]


def check_fields(inner_state: Any, names: Sequence[str]) -> None:
  """Raises ``ValueError`` unless every field in ``names`` is found."""
  for name in names:
    if not find_state_field(inner_state, name):
      raise ValueError(
          f'state_sync_every names the field {name!r}, which no NamedTuple '
          f'of the inner optimizer state has')
