"""The exchange between asynchronous learners and their syncer: a directory
written through Orbax.

Learners and the syncer never talk to each other; they read and write one
*store*, a directory on a shared filesystem, or a ``gs://`` / ``s3://``
bucket path. Every write goes through Orbax's ``CheckpointManager``
(TensorStore underneath for the arrays, ``etils.epath`` for the paths), so a
bucket path takes exactly the same code as a local directory; nothing here is
a network protocol of our own. Layout::

  STORE/global/<version>/       the syncer's merged model, one Orbax step per
                                version: items ``params``, ``outer`` (the
                                outer optimizer state) and ``meta`` (JSON:
                                counters, the payloads consumed per learner)
  STORE/payloads/<learner>/<n>/ learner ``<learner>``'s ``n``-th payload:
                                items ``delta`` (its pseudo-gradient, raw or
                                as a codec's payload arrays) and ``meta``
                                (JSON: base version, tokens, steps, bytes)
  STORE/learners/<learner>/<n>/ the learner's inner state after its payload
                                ``n``: items ``state`` (inner optimizer state,
                                step count) and ``meta`` (JSON: base version,
                                step, wall clock), for a restart that keeps
                                it or a peer that takes it

**Atomic, versioned writes.** Orbax writes a step into a temporary directory
and renames it into place when it is complete (on a local or NFS filesystem),
or writes a ``commit_success.txt`` marker last (on object stores, which have
no rename); readers list only finalized steps, so a process killed mid-write
leaves nothing that is ever read. A step that exists is never overwritten
(Orbax refuses: ``StepAlreadyExistsError``), so a version number names one
model for good. Old versions and payloads are deleted by the writer's
``max_to_keep``; a reader that loses a race with a deletion gets
:class:`Gone` and reads the newest again.

For a bucket, pass ``--store=gs://bucket/run`` (or ``s3://...``): the arrays
go through TensorStore's ``gcs`` / ``s3`` drivers, the directories and JSON
files through ``etils.epath``, which uses TensorFlow's ``gfile`` where
TensorFlow is installed and ``fsspec`` otherwise (then install ``gcsfs`` or
``s3fs``); credentials are those the libraries find. Tests use local
directories only: no bucket path has been run here.
"""

from collections.abc import Iterator
import dataclasses
import re
import time
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

GLOBAL = 'global'
PAYLOADS = 'payloads'
LEARNERS = 'learners'
_RETRIES = 5
_LEARNER_ID = re.compile(r'^[A-Za-z0-9_.-]+$')


class Gone(RuntimeError):
  """A step listed a moment ago was deleted (or is not readable) now."""


def check_learner_id(learner: str) -> str:
  """``learner`` if it is a usable directory name, else a ValueError."""
  if not isinstance(learner, str) or not _LEARNER_ID.match(learner):
    raise ValueError(f'learner id {learner!r}: use letters, digits, "_", '
                     '"-" or "." (it names a directory of the store)')
  return learner


def _manager(directory: epath.Path, *, write: bool, keep: int | None,
             items: tuple[str, ...]) -> ocp.CheckpointManager:
  # One process writes a directory; no barriers between processes. In a
  # learner of several processes (joined by jax.distributed) each process's
  # managers are its own: Orbax's barriers would otherwise wait for every
  # process of the job in each save and restore.
  me = jax.process_index()
  if write:  # Orbax will not create it with active_processes set
    directory.mkdir(parents=True, exist_ok=True)
  options = ocp.CheckpointManagerOptions(
      max_to_keep=keep, create=False, read_only=not write,
      enable_async_checkpointing=False,
      multiprocessing_options=ocp.options.MultiprocessingOptions(
          primary_host=me if jax.process_count() > 1 else None,
          active_processes={me} if jax.process_count() > 1 else None))
  handlers = {name: (ocp.JsonCheckpointHandler() if name == 'meta'
                     else ocp.StandardCheckpointHandler()) for name in items}
  return ocp.CheckpointManager(directory, options=options,
                               item_names=items, item_handlers=handlers)


def _finalized(mngr: ocp.CheckpointManager | None) -> list[int]:
  """The steps of ``mngr`` that Orbax finished writing: listed by Orbax
  (no temporary directory) and holding its ``commit_success.txt`` marker
  (written last on object stores; checked everywhere, so a directory made
  by anything but a finished Orbax write is never read)."""
  if mngr is None:
    return []
  root = epath.Path(mngr.directory)
  return sorted(s for s in mngr.all_steps()
                if (root / str(s) / 'commit_success.txt').exists())


def _host(tree: Any) -> Any:
  return jax.tree.map(np.asarray, tree)


def _abstract(tree: Any) -> Any:
  def one(x):
    if isinstance(x, jax.ShapeDtypeStruct):
      return jax.ShapeDtypeStruct(x.shape, x.dtype)
    return jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype)
  return jax.tree.map(one, tree)


@dataclasses.dataclass
class Payload:
  """One learner payload as read back: ``delta`` (the tree the learner
  saved) and ``meta`` (its JSON dict)."""

  learner: str
  seq: int
  meta: dict[str, Any]
  delta: Any


class Store:
  """One store (see the module doc) opened by one process.

  Args:
    root: the store's path (a directory, or ``gs://...``, ``s3://...``).
    keep_versions: how many global versions the syncer keeps.
    keep_payloads: how many payloads each learner keeps.
    keep_states: how many inner states each learner keeps (a peer taking
      one has ``keep_states - 1`` rounds to read it).
  """

  def __init__(self, root: str | epath.Path, *, keep_versions: int = 8,
               keep_payloads: int = 32, keep_states: int = 3):
    if not str(root):
      raise ValueError('store path is empty')
    self.root = epath.Path(root)
    self.keep_versions, self.keep_payloads = keep_versions, keep_payloads
    self.keep_states = keep_states
    self._readers: dict[str, ocp.CheckpointManager] = {}
    self._writers: dict[str, ocp.CheckpointManager] = {}

  # ------------------------------------------------------------ managers ---
  def _reader(self, key: str, directory: epath.Path,
              items: tuple[str, ...]) -> ocp.CheckpointManager | None:
    if key not in self._readers and not directory.exists():
      return None
    for attempt in range(_RETRIES):
      try:
        # Opening a manager lists the directory too, as a reload does.
        if key not in self._readers:
          self._readers[key] = _manager(directory, write=False, keep=None,
                                        items=items)
        else:
          self._readers[key].reload()
        break
      except FileNotFoundError:
        # a step was deleted (its writer's max_to_keep) while Orbax listed
        # the directory: list it again
        if attempt == _RETRIES - 1:
          raise
        time.sleep(0.05)
    return self._readers[key]

  def _writer(self, key: str, directory: epath.Path, keep: int | None,
              items: tuple[str, ...]) -> ocp.CheckpointManager:
    if key not in self._writers:
      self._writers[key] = _manager(directory, write=True, keep=keep,
                                    items=items)
    return self._writers[key]

  def close(self) -> None:
    for mngr in [*self._readers.values(), *self._writers.values()]:
      mngr.close()
    self._readers.clear()
    self._writers.clear()

  # ------------------------------------------------------ global versions ---
  def versions(self) -> list[int]:
    """The finalized global versions, oldest first."""
    mngr = self._reader('global', self.root / GLOBAL,
                        ('params', 'outer', 'meta'))
    return _finalized(mngr)

  def latest_version(self) -> int | None:
    versions = self.versions()
    return versions[-1] if versions else None

  def publish_global(self, version: int, params: Any, outer: Any,
                     meta: dict[str, Any]) -> None:
    """Writes global ``version`` atomically (fails if it exists)."""
    mngr = self._writer('global_w', self.root / GLOBAL, self.keep_versions,
                        ('params', 'outer', 'meta'))
    saved = mngr.save(version, args=ocp.args.Composite(
        params=ocp.args.StandardSave(_host(params)),
        outer=ocp.args.StandardSave(_host(outer)),
        meta=ocp.args.JsonSave(dict(meta, version=version))))
    mngr.wait_until_finished()
    if not saved:
      raise FileExistsError(f'global version {version} exists in '
                            f'{self.root / GLOBAL}; versions are never '
                            'overwritten')

  def read_global(self, version: int, params_like: Any,
                  outer_like: Any | None = None) -> tuple[Any, Any, dict]:
    """``(params, outer state or None, meta)`` of ``version``; the trees
    are restored into the structures of ``params_like`` / ``outer_like``
    (host numpy arrays)."""
    mngr = self._reader('global', self.root / GLOBAL,
                        ('params', 'outer', 'meta'))
    if mngr is None:
      raise Gone(f'no global versions in {self.root / GLOBAL}')
    items = {'params': ocp.args.StandardRestore(_abstract(params_like)),
             'meta': ocp.args.JsonRestore()}
    if outer_like is not None:
      items['outer'] = ocp.args.StandardRestore(_abstract(outer_like))
    try:
      out = mngr.restore(version, args=ocp.args.Composite(**items))
    except (FileNotFoundError, ValueError, KeyError) as e:
      raise Gone(f'global version {version}: {e}') from e
    return (_host(out['params']),
            None if outer_like is None else _host(out['outer']), out['meta'])

  # ------------------------------------------------------------ payloads ---
  def learners(self) -> list[str]:
    """The learners that have a payload directory."""
    base = self.root / PAYLOADS
    if not base.exists():
      return []
    return sorted(p.name for p in base.iterdir() if p.is_dir())

  def payload_seqs(self, learner: str) -> list[int]:
    """The finalized payload numbers of ``learner``, oldest first."""
    mngr = self._reader(f'p/{learner}', self.root / PAYLOADS / learner,
                        ('delta', 'meta'))
    return _finalized(mngr)

  def publish_payload(self, learner: str, seq: int, delta: Any,
                      meta: dict[str, Any]) -> None:
    """Writes ``learner``'s payload ``seq`` atomically."""
    check_learner_id(learner)
    mngr = self._writer(f'p/{learner}', self.root / PAYLOADS / learner,
                        self.keep_payloads, ('delta', 'meta'))
    saved = mngr.save(seq, args=ocp.args.Composite(
        delta=ocp.args.StandardSave(_host(delta)),
        meta=ocp.args.JsonSave(dict(meta, learner=learner, seq=seq))))
    mngr.wait_until_finished()
    if not saved:
      raise FileExistsError(f'payload {learner}/{seq} exists')

  def _read_meta(self, key: str, path: epath.Path, items, seq: int, what: str
                 ) -> dict[str, Any]:
    """The ``meta`` item of step ``seq`` under ``path``; :class:`Gone`
    (naming ``what``) when it cannot be read."""
    mngr = self._reader(key, path, items)
    try:
      return mngr.restore(seq, args=ocp.args.Composite(
          meta=ocp.args.JsonRestore()))['meta']
    except (FileNotFoundError, ValueError, KeyError, AttributeError) as e:
      raise Gone(f'{what}: {e}') from e

  def read_payload_meta(self, learner: str, seq: int) -> dict[str, Any]:
    return self._read_meta(f'p/{learner}', self.root / PAYLOADS / learner,
                           ('delta', 'meta'), seq, f'payload {learner}/{seq}')

  def read_payload(self, learner: str, seq: int,
                   delta_like: Any | None = None) -> Payload:
    """Payload ``seq`` of ``learner``, its delta restored into the
    structure of ``delta_like`` (default: as saved, numpy arrays)."""
    mngr = self._reader(f'p/{learner}', self.root / PAYLOADS / learner,
                        ('delta', 'meta'))
    try:
      out = mngr.restore(seq, args=ocp.args.Composite(
          delta=ocp.args.StandardRestore(
              None if delta_like is None else _abstract(delta_like)),
          meta=ocp.args.JsonRestore()))
    except (FileNotFoundError, ValueError, KeyError, AttributeError) as e:
      raise Gone(f'payload {learner}/{seq}: {e}') from e
    return Payload(learner, seq, out['meta'], _host(out['delta']))

  def new_payloads(self, consumed: dict[str, int]) -> Iterator[tuple[str,
                                                                     int]]:
    """``(learner, seq)`` of every finalized payload past ``consumed``
    (learner -> highest payload number already consumed), in order."""
    for learner in self.learners():
      last = consumed.get(learner, -1)
      for seq in self.payload_seqs(learner):
        if seq > last:
          yield learner, seq

  # ------------------------------------------------------ learner state ---
  def save_learner_state(self, learner: str, seq: int, state: Any,
                         meta: dict[str, Any] | None = None) -> None:
    """Publishes the learner's inner state (its inner optimizer state and
    step count) after its payload ``seq``, with ``meta`` (JSON: the base
    version the state belongs to, its step count, the writer's clock
    ``wall``): for a restart of the same learner (``rejoin_state='keep'``)
    or of a peer (``'peer'``). One atomic Orbax step per round; the newest
    ``keep_states`` are kept."""
    check_learner_id(learner)
    mngr = self._writer(f'l/{learner}', self.root / LEARNERS / learner,
                        self.keep_states, ('state', 'meta'))
    mngr.save(seq, args=ocp.args.Composite(
        state=ocp.args.StandardSave(_host(state)),
        meta=ocp.args.JsonSave(dict(meta or {}, learner=learner, seq=seq))))
    mngr.wait_until_finished()

  def learner_state_seqs(self, learner: str) -> list[int]:
    """The finalized inner-state numbers of ``learner``, oldest first."""
    return _finalized(self._reader(f'l/{learner}',
                                   self.root / LEARNERS / learner,
                                   ('state', 'meta')))

  def read_learner_state(self, learner: str, state_like: Any,
                         seq: int | None = None
                         ) -> tuple[int, Any] | None:
    """``(seq, state)`` of the learner's inner state ``seq`` (default: its
    newest), or None when it has none; :class:`Gone` if ``seq`` was
    deleted."""
    seqs = self.learner_state_seqs(learner)
    if not seqs:
      return None
    seq = seqs[-1] if seq is None else seq
    mngr = self._readers[f'l/{learner}']
    try:
      out = mngr.restore(seq, args=ocp.args.Composite(
          state=ocp.args.StandardRestore(_abstract(state_like))))
    except (FileNotFoundError, ValueError, KeyError, AttributeError) as e:
      raise Gone(f'inner state {learner}/{seq}: {e}') from e
    return seq, _host(out['state'])

  def read_learner_state_meta(self, learner: str, seq: int
                              ) -> dict[str, Any]:
    return self._read_meta(f'l/{learner}', self.root / LEARNERS / learner,
                           ('state', 'meta'), seq,
                           f'inner state {learner}/{seq}')

  def newest_peer_state(self, learner: str, *, now: float,
                        liveness_s: float) -> dict[str, Any] | None:
    """The meta of the inner state to take from a peer of ``learner``, or
    None when no live peer published one.

    A peer is every other learner with a published inner state; it is live
    if its newest one was written within ``liveness_s`` seconds of ``now``
    (by the writer's clock ``wall``, as the syncer judges liveness). Of the
    live peers' newest states, the one on the highest base version (the
    least stale), then the most recent, is taken; its meta names the peer
    (``learner``) and the state (``seq``).
    """
    base = self.root / LEARNERS
    if not base.exists():
      return None
    best = None
    for peer in sorted(p.name for p in base.iterdir() if p.is_dir()):
      if peer == learner:
        continue
      seqs = self.learner_state_seqs(peer)
      if not seqs:
        continue
      try:
        meta = self.read_learner_state_meta(peer, seqs[-1])
      except Gone:
        continue  # replaced meanwhile; its next one is newer still
      if now - meta.get('wall', float('-inf')) > liveness_s:
        continue
      key = (meta.get('base_version', -1), meta['wall'])
      if best is None or key > best[0]:
        best = key, meta
    return None if best is None else best[1]
