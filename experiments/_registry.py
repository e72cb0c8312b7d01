"""The registry of the docs tables' and figures' renderers.

Each renderer module (``experiments/_claims.py``, ``_train_tables.py``, ...)
registers its renderers here with :func:`tables` and :func:`figure`;
:mod:`experiments.tables` imports the renderer modules and reads
:data:`RENDERERS` and :data:`FIGURES`. The renderer modules import only
this module (and the number formats below), never :mod:`experiments.tables`,
so no module under ``experiments/`` imports one that imports it back
(``tests/test_experiments_imports.py``).
"""

from typing import Any, Callable

Renderer = Callable[[dict[str, Any]], str]

# (results name, table name) -> renderer of the markdown table.
RENDERERS: dict[tuple[str, str], Renderer] = {}

# results name -> (figure renderer, path under docs/).
FIGURES: dict[str, tuple[Callable[..., None], str]] = {}


def tables(entries: dict[tuple[str, str], Renderer]) -> None:
  """Registers ``{(results name, table name): renderer}``; a key already
  registered (by this module or another) is a ValueError naming it."""
  for key, fn in entries.items():
    if not (isinstance(key, tuple) and len(key) == 2
            and all(isinstance(k, str) for k in key)):
      raise ValueError(f'a table key is (results name, table name), got '
                       f'{key!r}')
    if key in RENDERERS and RENDERERS[key] is not fn:
      raise ValueError(f'table {key} is registered twice: by '
                       f'{RENDERERS[key].__module__}.'
                       f'{RENDERERS[key].__qualname__} and '
                       f'{fn.__module__}.{fn.__qualname__}')
    RENDERERS[key] = fn


def figure(name: str, draw: Callable[..., None], path: str) -> None:
  """Registers the figure of results ``name``, drawn by ``draw(data, path)``
  to ``docs/<path>``; a name already registered is a ValueError."""
  if name in FIGURES and FIGURES[name] != (draw, path):
    raise ValueError(f'figure {name!r} is registered twice: '
                     f'{FIGURES[name][1]} and {path}')
  FIGURES[name] = (draw, path)


def format_bytes(n: float) -> str:
  """``1536 -> '1.5 KiB'`` (as ``loc_opt.train.metrics.format_bytes``)."""
  for unit in ('B', 'KiB', 'MiB', 'GiB'):
    if abs(n) < 1024:
      return f'{n:.0f} {unit}' if unit == 'B' else f'{n:.1f} {unit}'
    n /= 1024
  return f'{n:.1f} TiB'


def mean_sd(values) -> tuple[float, float | None]:
  """Mean and sample standard deviation of seeds' values (None for one)."""
  n = len(values)
  mean = sum(values) / n
  if n < 2:
    return mean, None
  return mean, (sum((v - mean) ** 2 for v in values) / (n - 1)) ** 0.5


def format_time(seconds: float) -> str:
  """Seconds as ``'12.3 s'``, ``'4.5 min'`` or ``'1.23 h'``."""
  if seconds >= 3600:
    return f'{seconds / 3600:.2f} h'
  if seconds >= 60:
    return f'{seconds / 60:.1f} min'
  return f'{seconds:.1f} s'
