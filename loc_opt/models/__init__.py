"""Reference models behind a functional interface.

The trainer never touches an ``nnx.Module``: :func:`build_model` turns the
``model`` section of a config into a :class:`Model` of pure functions over
plain pytrees (``init``, ``apply``), the within-worker sharding ``specs`` and
the parameter count.

Example:
  >>> import ml_collections
  >>> config = ml_collections.ConfigDict({'name': 'transformer'})
  >>> model = build_model(config)
  >>> params = model.init(jax.random.key(0))
  >>> tokens = jnp.zeros((8, 65), jnp.int32)
  >>> logits = model.apply(params, tokens[:, :-1])
  >>> loss = lm_loss(logits, tokens[:, 1:])
"""

from collections.abc import Callable, Mapping
import dataclasses
from typing import Any, NamedTuple

import ml_collections

from loc_opt.models.core import from_nnx
from loc_opt.models.core import lm_loss
from loc_opt.models.core import Model
from loc_opt.models.core import resolve_specs
from loc_opt.models.mlp import build_mlp
from loc_opt.models.mlp import MLP
from loc_opt.models.mlp import MLPConfig
from loc_opt.models.transformer import build_transformer
from loc_opt.models.transformer import Transformer
from loc_opt.models.transformer import TransformerConfig


class ModelEntry(NamedTuple):
  """A registered model: its config dataclass and its ``Model`` builder."""

  config_cls: type
  build: Callable[[Any], Model]


REGISTRY: dict[str, ModelEntry] = {
    'transformer': ModelEntry(TransformerConfig, build_transformer),
    'mlp': ModelEntry(MLPConfig, build_mlp),
}


def build_model(config: ml_collections.ConfigDict | Mapping[str, Any]) -> Model:
  """Builds the :class:`Model` that ``config`` names.

  Args:
    config: the ``model`` config section: ``name`` (a key of
      :data:`REGISTRY`) and any fields of that model's config dataclass
      (e.g. :class:`TransformerConfig`); missing fields take the dataclass
      defaults. Dtypes may be strings (``'float32'``, ``'bfloat16'``).

  Returns:
    The functional model.

  Raises:
    ValueError: for an unknown ``model.name``, a field the model does not
      have, or invalid sizes; the message names the field.
  """
  fields = dict(
      config.to_dict() if hasattr(config, 'to_dict') else config
  )
  name = fields.pop('name', None)
  if name not in REGISTRY:
    raise ValueError(
        f'model.name={name!r} is not a known model; valid names: '
        f'{sorted(REGISTRY)}'
    )
  entry = REGISTRY[name]
  known = {f.name for f in dataclasses.fields(entry.config_cls)}
  unknown = sorted(set(fields) - known)
  if unknown:
    raise ValueError(
        f'model.{unknown[0]} is not a field of model {name!r} '
        f'(unknown: {unknown}); valid fields: {sorted(known)}'
    )
  return entry.build(entry.config_cls(**fields))


__all__ = [
    'MLP',
    'MLPConfig',
    'Model',
    'ModelEntry',
    'REGISTRY',
    'Transformer',
    'TransformerConfig',
    'build_mlp',
    'build_model',
    'build_transformer',
    'from_nnx',
    'lm_loss',
    'resolve_specs',
]
