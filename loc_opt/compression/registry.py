"""Every codec and compressor by name, for configs and launchers.

``make_compressor(name, **kwargs)`` accepts the name of a codec (wrapped with
:func:`~loc_opt.compression.from_codec`) or of a stateful compressor. A
``value_codec`` given by name (top-k with 2-bit values) is resolved here, so
configs can say ``{'value_codec': 'two_bit'}``.

:func:`as_compressor` is the one door through which every library function
that takes a codec (``loc_opt.diloco(..., codec=...)``,
``streaming_diloco``, ``eager_diloco``, ``compressed_all_reduce``,
``compressed_mean``) turns its argument into a compressor, so all of them
accept a name (``codec='int8'``) or a name with arguments
(``codec=('statistical', {'bits': 2})``) as well as a codec or compressor
object.
"""

from collections.abc import Callable, Mapping
from typing import Any

from loc_opt.compression import codecs
from loc_opt.compression import compressor as compressor_lib
from loc_opt.compression.dgc import dgc
from loc_opt.compression.powersgd import powersgd
from loc_opt.compression.quant import QUANT_CODECS
from loc_opt.compression.sparse import SPARSE_CODECS
from loc_opt.compression.statistical import row_linear
from loc_opt.compression.statistical import statistical
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
    'statistical': statistical,
    'row_linear': row_linear,
}


# What a function that takes a codec accepts: an object, a registered name,
# or ``(name, kwargs)``; ``None`` is the fp32 mean.
Scheme = (Compressor | Codec | str | tuple[str, Mapping[str, Any]] | None)


def _unknown(name: str, field: str, known) -> ValueError:
  return ValueError(f'unknown codec {name!r} for {field}; choose one of '
                    f'{sorted(known)}')


def make_codec(name: str, *, field: str = 'codec',
               **kwargs: Any) -> Codec:
  """The codec ``name`` of :data:`CODECS`, built with ``kwargs``."""
  if name not in CODECS:
    raise _unknown(name, field, CODECS)
  value_codec = kwargs.get('value_codec')
  if isinstance(value_codec, str):
    kwargs['value_codec'] = make_codec(value_codec, field=f'{field} '
                                       'value_codec')
  return CODECS[name](**kwargs)


def make_compressor(name: str, *, field: str = 'codec',
                    reduce: str = 'gather', workers: int | None = None,
                    **kwargs: Any) -> Compressor:
  """A compressor by name: one of :data:`COMPRESSORS`, or any codec.

  Args:
    name: e.g. ``'int8'``, ``'fp4_e3m0'``, ``'topk'``, ``'powersgd'``.
    field: the argument or config field that named it, for error messages.
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


def as_compressor(scheme: Scheme, *, field: str = 'codec') -> Compressor:
  """A compressor from anything a codec argument accepts.

  Args:
    scheme: a :class:`~loc_opt.compression.Compressor`, a
      :class:`~loc_opt.compression.Codec`, ``None`` (the fp32 mean), a name
      of :data:`CODECS` or :data:`COMPRESSORS` (built with its defaults), or
      ``(name, kwargs)`` with the factory's keyword arguments.
    field: the argument or config field that gave ``scheme``, for errors.

  Returns:
    The compressor (codecs go through
    :func:`~loc_opt.compression.from_codec`, all-gather reduction).

  Raises:
    ValueError: for an unknown name (the message lists the known ones).
    TypeError: for anything else that is not a scheme.

  Example:
    >>> tx = loc_opt.diloco(optax.adamw(4e-4), sync_every=30,
    ...                     codec=('statistical', {'bits': 2}))
  """
  if isinstance(scheme, str):
    return make_compressor(scheme, field=field)
  if isinstance(scheme, tuple) and len(scheme) == 2 and isinstance(
      scheme[0], str):
    name, kwargs = scheme
    if not isinstance(kwargs, Mapping):
      raise TypeError(f'{field}: expected (name, kwargs) with a dict of '
                      f'keyword arguments, got {scheme!r}')
    return make_compressor(name, field=field, **dict(kwargs))
  if scheme is not None and not isinstance(
      scheme, (compressor_lib.Compressor, codecs.Codec)):
    raise TypeError(f'{field} must be a loc_opt.compression codec or '
                    'compressor, a codec name or (name, kwargs), got '
                    f'{scheme!r}')
  return compressor_lib.to_compressor(scheme)
