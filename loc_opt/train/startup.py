"""Startup progress: one line per phase before the first step.

The launcher (``loc-opt-train``) reports the dataset, each program it
compiles (``compiling train step k of n ... s``) and a checkpoint restore,
so that the minute before the progress bar is not silent. Library calls
(``train_and_evaluate`` in a notebook or a test) report nothing unless they
ask for it with :func:`report_to`.
"""

import contextlib
import contextvars
import time
from collections.abc import Callable, Iterator

_SINK: contextvars.ContextVar[Callable[[str], None] | None] = (
    contextvars.ContextVar('loc_opt_startup_sink', default=None))


@contextlib.contextmanager
def report_to(sink: Callable[[str], None] | None) -> Iterator[None]:
  """Sends the startup lines inside the block to ``sink`` (None: nowhere)."""
  token = _SINK.set(sink)
  try:
    yield
  finally:
    _SINK.reset(token)


def say(text: str) -> None:
  """One startup line, to the sink set by :func:`report_to` if any."""
  sink = _SINK.get()
  if sink is not None:
    sink(text)


@contextlib.contextmanager
def phase(text: str) -> Iterator[None]:
  """``text ...`` now and ``text: done in S s`` at the end of the block."""
  say(f'{text} ...')
  t0 = time.perf_counter()
  yield
  say(f'{text}: done in {time.perf_counter() - t0:.1f} s')
