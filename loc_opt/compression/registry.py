"""Every codec and compressor by name, for configs and launchers.

``make_compressor(name, **kwargs)`` accepts the name of a codec (wrapped with
:func:`~loc_opt.compression.from_codec`) or of a stateful compressor. A
``value_codec`` given by name (top-k with 2-bit values) is resolved here, so
configs can say ``{'value_codec': 'two_bit'}``.
"""

from collections.abc import Callable, Mapping
from typing import Any

from loc_opt.compression import codecs
from loc_opt.compression import compressor as compressor_lib
from loc_opt.compression.dgc import dgc
from loc_opt.compression.powersgd import powersgd
from loc_opt.compression.quant import QUANT_CODECS
from loc_opt.compression.sparse import SPARSE_CODECS
from loc_opt.compression.terngrad import terngrad

Codec = codecs.Codec
Compressor = compressor_lib.Compressor

CODECS: Mapping[str, Callable[..., Codec]] = {
    'none': codecs.identity,
    **QUANT_CODECS,
    **SPARSE_CODECS,
}

COMPRESSORS: Mapping[str, Callable[..., Compressor]] = {
    'powersgd': powersgd,
    'terngrad': terngrad,
    'dgc': dgc,
}


def _unknown(name: str, field: str, known) -> ValueError:
  return ValueError(f'unknown codec {name!r} (field {field}); choose one of '
                    f'{sorted(known)}')


def make_codec(name: str, *, field: str = 'outer.codec',
               **kwargs: Any) -> Codec:
  """The codec ``name`` of :data:`CODECS`, built with ``kwargs``."""
  if name not in CODECS:
    raise _unknown(name, field, CODECS)
  value_codec = kwargs.get('value_codec')
  if isinstance(value_codec, str):
    kwargs['value_codec'] = make_codec(value_codec, field=f'{field} '
                                       'value_codec')
  return CODECS[name](**kwargs)


def make_compressor(name: str, *, field: str = 'outer.codec',
                    reduce: str = 'gather', workers: int | None = None,
                    **kwargs: Any) -> Compressor:
  """A compressor by name: one of :data:`COMPRESSORS`, or any codec.

  Args:
    name: e.g. ``'int8'``, ``'fp4_e3m0'``, ``'topk'``, ``'powersgd'``.
    field: the config field that named it, for error messages.
    reduce: for codecs, ``'gather'`` or ``'two_phase'`` (see
      :func:`~loc_opt.compression.from_codec`); compressors with their own
      collectives take only ``'gather'``.
    workers: the worker count, needed by ``'two_phase'``.
    **kwargs: the factory's arguments.

  Returns:
    The compressor (stateless for codecs).
  """
  if name in COMPRESSORS:
    if reduce != 'gather':
      raise ValueError(f'{name!r} has its own collectives; reduce={reduce!r} '
                       'applies to codecs only')
    return COMPRESSORS[name](**kwargs)
  if name in CODECS:
    return compressor_lib.from_codec(make_codec(name, field=field, **kwargs),
                                     reduce=reduce, workers=workers)
  raise _unknown(name, field, {**CODECS, **COMPRESSORS})
