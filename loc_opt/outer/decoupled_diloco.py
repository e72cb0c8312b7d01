"""Decoupled DiLoCo: learners on their own clocks, a syncer that merges
whatever has arrived.

Learners (the workers) run inner steps without ever waiting for each other.
The parameters are split into ``P`` fragments (:func:`balanced_fragments`:
whole tensors bin-packed to near-equal size). When a fragment comes due, a
synchronizer merges the fragments of the learners it admitted (a minimum
quorum, then a short grace window: :mod:`loc_opt.outer.decoupled_clock`
decides who, on a virtual clock), weights each learner by the tokens it
processed since it last received that fragment, takes an outer Nesterov
step on the fragment, and sends the new global fragment back; a learner
overwrites its copy when it arrives.

Here: the transform :func:`decoupled_diloco` (its merge rules are pure
functions in :mod:`loc_opt.outer.decoupled_merge`), run on the worker axis
like the whole family, with the timeline's decisions per learner
(``active``, ``admitted``, ...).

Choices where the published description is ambiguous (see
``docs/decoupled_diloco.md``):

* the outer gradient is ``Delta_m = Theta_p - theta_m``, against the
  syncer's previous global fragment (attributed to the paper's App. D.2).
  Every live learner receives a merged fragment before it is merged again
  (the timeline ensures it) and a returning learner starts from the global
  fragments, so the learner's base version is the same value here;
* RDA per parameter leaf (``rda_scope='leaf'``) or per whole fragment
  (``'fragment'``);
* a received fragment overwrites the local copy (``alpha=0``) or is blended
  with it, as Streaming DiLoCo's ``alpha``;
* where the mean direction cancels (``|u| <= rda_eps``) RDA falls back to
  the weighted average (a ``lax.cond`` branch: its all-reduce runs only
  then).

References:
  Douillard et al., *Decoupled DiLoCo for Resilient Distributed
  Pre-training*, 2026. https://arxiv.org/abs/2604.21428
  Douillard et al., *Streaming DiLoCo with overlapping communication*, 2025.
"""

from collections.abc import Callable
import re
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from loc_opt import _checks
from loc_opt import compression
from loc_opt.compression import feedback
from loc_opt.outer import _fragments
from loc_opt.outer import _local
from loc_opt.outer import decoupled_clock
from loc_opt.outer._fragments import balanced_fragments  # noqa: F401
# The merge rules live in decoupled_merge; these names stay importable here.
from loc_opt.outer.decoupled_merge import merge_fragment
from loc_opt.outer.decoupled_merge import merge_stacked  # noqa: F401
from loc_opt.outer.decoupled_merge import radial_directional_average  # noqa: F401
from loc_opt.outer.decoupled_merge import token_weight
from loc_opt.outer.decoupled_merge import weighted_average  # noqa: F401

MeanFn = Callable[[Any], Any]
MERGES = ('rda', 'average')
RDA_SCOPES = ('leaf', 'fragment')
WEIGHTINGS = ('tokens', 'uniform')
REJOIN_STATES = ('keep', 'fresh', 'peer')
# Leaves averaged directly under RDA: the input embedding (the paper's
# embedding outer gradients are not near-orthogonal across learners).
DIRECT_PATTERN = r'(^|/)embed'


# ---------------------------------------------------------- transform ---
class DecoupledDilocoState(NamedTuple):
  """State of :func:`decoupled_diloco` (one learner's copy).

  Attributes:
    inner_state: the learner's inner optimizer state.
    anchor: the global fragments ``Theta`` (the syncer's copy; same on every
      learner), fp32 by default.
    outer_state: tuple of ``P`` outer optimizer states, one per fragment over
      its pieces (the syncer's; same on every learner).
    count: int32 scalar, program steps (ticks of the timeline) taken.
    merges: int32 ``[P]``, merges applied to each global fragment.
    steps_since: float32 ``[P]``, ``c_steps``: inner steps this learner took
      since it last received each fragment.
    tokens_since: float32 ``[P]``, ``c_tokens``: tokens it processed since.
    inner_steps: int32 scalar, inner steps this learner took.
    codec_state: tuple of ``P`` compressor states (``()`` without a codec).
    left_out: int32 scalar, merges this learner was not part of (not
      admitted, or its fragment was not finite).
  """

  inner_state: optax.OptState
  anchor: optax.Params
  outer_state: tuple[optax.OptState, ...]
  count: jax.Array
  merges: jax.Array
  steps_since: jax.Array
  tokens_since: jax.Array
  inner_steps: jax.Array
  codec_state: Any
  left_out: jax.Array


class _Config(NamedTuple):
  """The static settings of one :func:`decoupled_diloco` transform."""

  num_fragments: int
  outer: optax.GradientTransformation
  merge: str
  scope: str
  weighting: str
  alpha: float
  rejoin_state: str
  eps: float
  direct_pattern: str | None
  compressor: compression.Compressor | None
  comm: compression.Comm | None
  codec_seed: int


class _Step:
  """One update of one learner, with the timeline's decisions."""

  def __init__(self, cfg: _Config, state: DecoupledDilocoState,
               groups: list[list[_fragments.Piece]], direct: list[bool],
               params: Any, updates: Any):
    self.cfg, self.state, self.groups, self.direct = cfg, state, groups, \
        direct
    self.p_leaves, self.treedef = jax.tree.flatten(params)
    # theta after this step's inner update (params where inactive)
    self.local = [optax.apply_updates(p, u) for p, u in
                  zip(self.p_leaves, self.treedef.flatten_up_to(updates))]
    self.a_leaves = jax.tree.leaves(state.anchor)

  def pieces(self, leaves: list[jax.Array], p: int) -> list[jax.Array]:
    return [_fragments.take(leaves[i], rows) for i, rows in self.groups[p]]

  def merge(self, p: int, weight: jax.Array, codec_states: Any
            ) -> tuple[list[jax.Array], Any, Any, jax.Array, jax.Array]:
    """Fragment ``p``'s new global pieces and outer state, the codec
    states, whether this learner's fragment entered the merge, and whether
    any did (else the syncer keeps the fragment)."""
    cfg, state = self.cfg, self.state
    anchor = self.pieces(self.a_leaves, p)
    delta = _local.pseudo_gradient(anchor, self.pieces(self.local, p))
    weight = jnp.where(_local.all_finite(delta), weight, 0.)
    included = weight > 0
    delta = [jnp.where(included, d, jnp.zeros_like(d)) for d in delta]
    mean_fn = _local.identity if cfg.comm is None else cfg.comm.pmean
    payload_mean, new_codec = None, [codec_states]
    if cfg.compressor is not None:
      key = jax.random.fold_in(jax.random.key(cfg.codec_seed), state.count)
      # Error feedback is kept in unweighted units (the payload over w):
      # the weight w = c_tokens^2 / c_steps changes between merges, so a
      # residual stored as w_old x would enter the next payload w_new x
      # at the wrong scale. It is scaled by this merge's w on the way in
      # and by 1 / w on the way out.
      scale = cfg.weighting == 'tokens'
      inv = jnp.where(weight > 0, 1. / jnp.maximum(weight, 1e-30), 0.)

      def payload_mean(tree):
        cs_in = (_scale_errors(codec_states[p], weight) if scale
                 else codec_states[p])
        mean, _, cs = cfg.compressor.mean(tree, cs_in, cfg.comm, key)
        if scale:
          cs = _scale_errors(cs, inv)
        # a learner left out keeps its error buffers as they were
        cs = jax.tree.map(lambda n, o: _local.select_leaf(included, n, o),
                          cs, codec_states[p])
        new_codec[0] = codec_states[:p] + (cs,) + codec_states[p + 1:]
        return [m.astype(x.dtype) for m, x in zip(mean, tree)]

    merged = merge_fragment(
        delta, weight, mean_fn, payload_mean,
        direct=[self.direct[i] for i, _ in self.groups[p]], merge=cfg.merge,
        scope=cfg.scope, eps=cfg.eps)
    any_in = mean_fn(weight) > 0
    updates, new_outer = cfg.outer.update(merged, state.outer_state[p],
                                          anchor)
    new_anchor = optax.apply_updates(anchor, updates)
    new_anchor = [jnp.where(any_in, n, a) for n, a in zip(new_anchor, anchor)]
    new_outer = jax.tree.map(lambda n, o: _local.select_leaf(any_in, n, o),
                             new_outer, state.outer_state[p])
    return new_anchor, new_outer, new_codec[0], included, any_in

  def receive(self, anchor: list[jax.Array], receive: jax.Array
              ) -> list[jax.Array]:
    """The local leaves after the fragments ``receive`` (bool ``[P]``)
    arrive: ``alpha theta + (1 - alpha) Theta`` there (``Theta`` itself with
    the default ``alpha = 0``), ``theta`` elsewhere."""
    alpha, out = self.cfg.alpha, list(self.local)
    for q, group in enumerate(self.groups):
      for i, rows in group:
        mine = _fragments.take(out[i], rows)
        glob = _fragments.take(anchor[i], rows).astype(mine.dtype)
        new = glob if not alpha else alpha * mine + (1 - alpha) * glob
        out[i] = _fragments.put(out[i], rows,
                                jnp.where(receive[q], new, mine))
    return out


def _scale_errors(codec_state: Any, factor: jax.Array) -> Any:
  """``codec_state`` with every error-feedback buffer
  (:func:`loc_opt.compression.error_feedback`) times ``factor``."""
  def one(x):
    if isinstance(x, feedback.ErrorFeedbackState):
      return feedback.ErrorFeedbackState(
          _scale_errors(x.inner, factor),
          jax.tree.map(lambda e: e * factor.astype(e.dtype), x.error))
    return x

  return jax.tree.map(
      one, codec_state,
      is_leaf=lambda x: isinstance(x, feedback.ErrorFeedbackState))


def _check_codec_state(codec_state: Any, compressor: compression.Compressor
                       ) -> None:
  """Refuses, with token weights, a compressor whose per-learner state is
  in weighted units and cannot be rescaled per learner (EF21, EControl,
  or a scheme with its own error buffers, e.g. PowerSGD, DGC)."""
  def kinds(x) -> set[type]:
    if isinstance(x, dict):
      x = list(x.values())
    if not isinstance(x, (tuple, list)):
      return set()
    own = {type(x)} if hasattr(x, '_fields') else set()
    return own.union(*(kinds(v) for v in x))

  found = kinds(codec_state)
  if (found & {feedback.EF21State, feedback.EControlState}) or (
      compressor.feedback and feedback.ErrorFeedbackState not in found):
    raise ValueError(
        f'decoupled_diloco(weighting=\'tokens\') with codec '
        f'{compressor.name!r}: its per-learner state holds the weighted '
        'payload w x, and the token weight w changes between merges; only '
        'compression.error_feedback buffers are rescaled. Use '
        'compression.error_feedback, or weighting=\'uniform\'')


def _weight(cfg: _Config, admitted: jax.Array, steps: jax.Array,
            tokens: jax.Array) -> jax.Array:
  """This learner's merge weight for one fragment (0 unless admitted)."""
  if cfg.weighting == 'tokens':
    w = token_weight(tokens, steps)
  else:
    w = (steps > 0).astype(jnp.float32)
  return jnp.where(admitted, w, 0.)


def _peer(cfg: _Config, tree: Any, source: int) -> Any:
  """Learner ``source``'s copy of ``tree``, on every learner (one
  all-reduce: only the source contributes)."""
  me = jax.lax.axis_index(cfg.comm.bound_axis)

  def leaf(x):
    return jax.lax.psum(jnp.where(me == source, x, jnp.zeros_like(x)),
                        cfg.comm.bound_axis)

  return jax.tree.map(leaf, tree)


def _masks(num_fragments: int, merge: int | None, active, admitted,
           receive, rejoin, tokens) -> tuple[jax.Array, ...]:
  """The per-learner decisions with their defaults: active, admitted, no
  rejoin, one token per inner step, and (with no ``receive`` given) the
  merged fragment received on the same step."""
  true = jnp.bool_(True)
  active = true if active is None else jnp.asarray(active, bool)
  admitted = true if admitted is None else jnp.asarray(admitted, bool)
  rejoin = jnp.bool_(False) if rejoin is None else jnp.asarray(rejoin, bool)
  if receive is None:
    receive = np.zeros([num_fragments], bool)
    if merge is not None:
      receive[merge] = True
  receive = jnp.asarray(receive, bool)
  tokens = jnp.float32(1.) if tokens is None else jnp.asarray(tokens,
                                                              jnp.float32)
  return active, admitted, receive, rejoin, tokens


def decoupled_diloco(
    inner: optax.GradientTransformation,
    *,
    num_fragments: int | None = None,
    fragments: Any | _fragments.FragmentFn | None = None,
    outer: optax.GradientTransformation | None = None,
    merge: str = 'rda',
    rda_scope: str = 'leaf',
    rda_eps: float = 1e-6,
    direct_pattern: str | None = DIRECT_PATTERN,
    weighting: str = 'tokens',
    alpha: float = 0.0,
    rejoin_state: str = 'keep',
    axis_name: str | None = 'worker',
    anchor_dtype: Any = jnp.float32,
    codec: compression.Scheme = None,
    codec_seed: int = 0,
) -> optax.GradientTransformationExtraArgs:
  r"""Decoupled DiLoCo's learner and syncer numerics (Douillard et al., 2026).

  One ``update`` is one tick of the timeline
  (:func:`loc_opt.outer.decoupled_timeline`) for one learner, in this order:

  1. **Inner step**, if ``active``: ``theta' = theta + inner(g)``; the
     learner's counters ``c_steps`` and ``c_tokens`` of every fragment grow
     by one step and ``tokens``. An inactive learner (slower, or down)
     keeps its parameters and inner state.
  2. **Merge** of fragment ``p`` when the static phase ``sync = (p, _)``:
     each learner's ``Delta_m = Theta_p - theta'_{m,p}``, weighted by
     ``w_m = c_tokens^2 / c_steps`` (``weighting='tokens'``; or 1 for any
     learner with a step, ``'uniform'``; 0 unless ``admitted``, or if
     ``Delta_m`` is not finite), merged by :func:`merge_fragment` (RDA, with
     embeddings averaged directly), then an outer step on the fragment with
     its own outer state: ``Theta_p <- Theta_p + outer(merged)``. With no
     learner admitted the fragment stays.
  3. **Receive**: for each fragment in ``receive`` (bool ``[P]``; default
     the fragment merged on this step), ``theta_q <- Theta_q`` (or ``alpha
     theta_q + (1 - alpha) Theta_q``) and its counters restart at 0.
  4. **Rejoin**, if ``rejoin`` (a learner back from a failure): every
     fragment from the global ``Theta``, counters 0, and the inner state
     kept (``rejoin_state='keep'``), re-initialised (``'fresh'``) or copied
     from the live learner ``source`` named by the phase ``(_, source)``
     (``'peer'``; one all-reduce of the inner state on that step).

  The update returned is ``target - params``, so ``optax.apply_updates``
  stays the only way the parameters change. Everything crossing learners is
  in the merge phase's program: the weighted pieces (``w Delta`` or ``w
  phi(Delta)``, through ``codec`` if given, with its error feedback per
  learner and fragment) and a few fp32 scalars. With every learner active
  and admitted, ``weighting='uniform'``, ``merge='average'`` and the default
  ``receive``, each merge is Streaming DiLoCo's fragment sync with ``tau =
  0``, ``alpha = 0`` (tested).

  Args:
    inner: the inner optimizer (may take extra args).
    num_fragments: ``P``; required unless ``fragments`` is a tree of ints.
    fragments: which fragment each leaf belongs to (a tree of ints, or a
      stacked leaf's tuple of row ids, or ``(path, leaf) -> ids``); default
      :func:`balanced_fragments`.
    outer: the outer optimizer per fragment (default Nesterov SGD, lr 0.7,
      momentum 0.9: the description gives no values; DiLoCo's).
    merge: ``'rda'`` (radial-directional averaging, embeddings direct) or
      ``'average'`` (the weighted average everywhere).
    rda_scope: RDA per ``'leaf'`` (default) or per ``'fragment'``.
    rda_eps: RDA falls back to the weighted average where the mean
      direction's norm is at most this.
    direct_pattern: a regex on leaf paths (``'embed/embedding'``) of the
      leaves averaged directly under RDA; None: none.
    weighting: ``'tokens'`` (``c_tokens^2 / c_steps``) or ``'uniform'``.
    alpha: weight of the local copy when a fragment arrives (0: overwrite,
      the described default).
    rejoin_state: a returning learner's inner state: ``'keep'`` (its own,
      stale), ``'fresh'`` (``inner.init``) or ``'peer'`` (a live learner's).
    axis_name: the learner axis (``None``: one learner, no collectives).
    anchor_dtype: minimum precision of the global fragments and outer state.
    codec: compress the weighted pieces (a ``loc_opt.compression`` codec,
      compressor or name, e.g. ``'int4'``; error feedback from the scheme,
      e.g. ``('int4', {})`` wrapped by ``compression.error_feedback``).
      With token weights the error-feedback buffers are kept in unweighted
      units (scaled by this merge's ``w`` going in and by ``1 / w`` coming
      out), since ``w`` changes between merges; schemes whose state cannot
      be rescaled per learner (EF21, EControl, PowerSGD, DGC) are refused
      with token weights. A rejoining learner's codec state restarts.
    codec_seed: seed of the shared key of codecs that draw random numbers.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose ``update(updates,
    state, params, *, sync, active=None, admitted=None, receive=None,
    rejoin=None, tokens=None, present=None, **inner_args)`` takes the
    static phase ``sync`` (``False`` or ``(merge, source)``, see
    :func:`loc_opt.outer.decoupled_clock.check_phase`) and per-learner
    decisions (bool scalars, ``receive`` bool ``[P]``, ``tokens`` a float;
    defaults: active, admitted, no rejoin, one token per step;
    ``present=False`` leaves the learner out like ``admitted=False``).

  References:
    Douillard et al., *Decoupled DiLoCo for Resilient Distributed
    Pre-training*, 2026. https://arxiv.org/abs/2604.21428
  """
  _checks.transformation(inner, 'inner')
  _checks.transformation(outer, 'outer', optional=True)
  if num_fragments is None and (fragments is None or callable(fragments)):
    raise ValueError('decoupled_diloco needs num_fragments unless fragments '
                     'is a tree of ints')
  p_count = _fragments.num_fragments_of(num_fragments, fragments)
  _checks.one_of(merge, 'merge', MERGES)
  _checks.one_of(rda_scope, 'rda_scope', RDA_SCOPES)
  _checks.one_of(weighting, 'weighting', WEIGHTINGS)
  _checks.one_of(rejoin_state, 'rejoin_state', REJOIN_STATES)
  alpha = _checks.in_interval(alpha, 'alpha', 0, 1)
  rda_eps = _checks.in_interval(rda_eps, 'rda_eps', 0, 1)
  if (codec is not None or rejoin_state == 'peer') and axis_name is None:
    raise ValueError('decoupled_diloco with a codec or rejoin_state="peer" '
                     'needs an axis_name')
  inner = optax.with_extra_args_support(inner)
  cfg = _Config(
      num_fragments=p_count,
      outer=_local.nesterov_outer() if outer is None else outer,
      merge=merge, scope=rda_scope, weighting=weighting, alpha=alpha,
      rejoin_state=rejoin_state, eps=rda_eps, direct_pattern=direct_pattern,
      compressor=None if codec is None else compression.as_compressor(codec),
      comm=compression.Comm(axis_name) if axis_name is not None else None,
      codec_seed=codec_seed)

  def split(params):
    ids = (fragments if fragments is not None
           else _fragments.balanced_fragments(params, p_count))
    return _fragments.pieces(
        _fragments.leaf_fragments(params, ids, p_count), p_count)

  def direct(params):
    if cfg.direct_pattern is None:
      return [False] * len(jax.tree.leaves(params))
    regex = re.compile(cfg.direct_pattern)
    return [bool(regex.search(_fragments._path_name(path)))  # pylint: disable=protected-access
            for path, _ in jax.tree_util.tree_flatten_with_path(params)[0]]

  def init_fn(params):
    return _init(cfg, inner, params, split(params), anchor_dtype)

  def update_fn(updates, state, params=None, *, sync=None, active=None,
                admitted=None, receive=None, rejoin=None, tokens=None,
                present=None, **extra_args):
    if sync is None:
      raise ValueError(
          'decoupled_diloco needs the static phase sync= of its timeline '
          '(loc_opt.outer.decoupled_timeline(...).plan()): False or '
          '(merge, source)')
    merge_p, source = decoupled_clock.check_phase(sync, p_count)
    if source is not None and cfg.rejoin_state != 'peer':
      source = None
    active, admitted, receive, rejoin, tokens = _masks(
        p_count, merge_p, active, admitted, receive, rejoin, tokens)
    active = active & jnp.logical_not(rejoin)  # a returning learner waits
    if present is not None:  # worker dropout, as loc_opt.diloco takes it
      admitted = admitted & jnp.asarray(present, bool)
    return _update(cfg, inner, split(params), direct(params), updates, state,
                   params, extra_args, merge_p, source, active, admitted,
                   receive, rejoin, tokens)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _init(cfg: _Config, inner: optax.GradientTransformation, params: Any,
          groups: list[list[_fragments.Piece]], anchor_dtype: Any
          ) -> DecoupledDilocoState:
  """The initial state: the anchor, and one outer state (and codec state)
  per fragment over its anchor pieces."""
  anchor, parts = _fragments.anchor_parts(params, groups, anchor_dtype)
  zeros = jnp.zeros([cfg.num_fragments], jnp.float32)
  codec_state = (() if cfg.compressor is None else
                 tuple(cfg.compressor.init(part) for part in parts))
  if cfg.compressor is not None and cfg.weighting == 'tokens':
    _check_codec_state(codec_state, cfg.compressor)
  return DecoupledDilocoState(
      inner_state=inner.init(params), anchor=anchor,
      outer_state=tuple(cfg.outer.init(part) for part in parts),
      count=jnp.zeros([], jnp.int32),
      merges=jnp.zeros([cfg.num_fragments], jnp.int32), steps_since=zeros,
      tokens_since=zeros, inner_steps=jnp.zeros([], jnp.int32),
      codec_state=codec_state, left_out=jnp.zeros([], jnp.int32))


def _update(cfg, inner, groups, direct, updates, state, params, extra_args,
            merge_p, source, active, admitted, receive, rejoin, tokens):
  """The body of ``update`` (see :func:`decoupled_diloco`)."""
  inner_updates, inner_state = _local.inner_step(
      inner, 'decoupled_diloco', updates, state.inner_state, params,
      extra_args)
  inner_updates = jax.tree.map(
      lambda u: jnp.where(active, u, jnp.zeros_like(u)), inner_updates)
  inner_state = jax.tree.map(
      lambda n, o: _local.select_leaf(active, n, o), inner_state,
      state.inner_state)
  step_inc = active.astype(jnp.float32)
  steps_since = state.steps_since + step_inc
  tokens_since = state.tokens_since + step_inc * tokens
  step = _Step(cfg, state, groups, direct, params, inner_updates)
  anchor, outer_state = list(step.a_leaves), state.outer_state
  codec_states, merges, left_out = state.codec_state, state.merges, \
      state.left_out
  if merge_p is not None:
    weight = _weight(cfg, admitted, steps_since[merge_p],
                     tokens_since[merge_p])
    pieces, new_outer, codec_states, included, any_in = step.merge(
        merge_p, weight, codec_states)
    for (i, rows), a in zip(groups[merge_p], pieces):
      anchor[i] = _fragments.put(anchor[i], rows, a)
    outer_state = (outer_state[:merge_p] + (new_outer,)
                   + outer_state[merge_p + 1:])
    merges = merges + any_in * jax.nn.one_hot(merge_p, cfg.num_fragments,
                                              dtype=jnp.int32)
    left_out = left_out + jnp.logical_not(included).astype(jnp.int32)
  target = step.receive(anchor, receive)
  target = [jnp.where(rejoin, a.astype(t.dtype), t)
            for a, t in zip(anchor, target)]
  reset = receive | rejoin
  steps_since = jnp.where(reset, 0., steps_since)
  tokens_since = jnp.where(reset, 0., tokens_since)
  if cfg.compressor is not None:
    # A returning learner starts from the global fragments: the residual it
    # had not sent belongs to a delta that is gone; its codec state restarts.
    fresh_codec = tuple(cfg.compressor.init(step.pieces(anchor, q))
                        for q in range(cfg.num_fragments))
    codec_states = jax.tree.map(
        lambda n, o: _local.select_leaf(rejoin, n, o), fresh_codec,
        codec_states)
  if cfg.rejoin_state == 'fresh':
    fresh = inner.init(step.treedef.unflatten(target))
    inner_state = jax.tree.map(lambda n, o: _local.select_leaf(rejoin, n, o),
                               fresh, inner_state)
  elif source is not None:
    peer = _peer(cfg, inner_state, source)
    inner_state = jax.tree.map(lambda n, o: _local.select_leaf(rejoin, n, o),
                               peer, inner_state)
  out = _local.updates_to(target, step.p_leaves)
  new_state = DecoupledDilocoState(
      inner_state=inner_state, anchor=step.treedef.unflatten(anchor),
      outer_state=outer_state, count=optax.safe_increment(state.count),
      merges=merges, steps_since=steps_since, tokens_since=tokens_since,
      inner_steps=state.inner_steps + active.astype(jnp.int32),
      codec_state=codec_states, left_out=left_out)
  out, new_state = _local.varying_fn(cfg.comm)((out, new_state))
  return step.treedef.unflatten(out), new_state


def decoupled_eval_params(state: DecoupledDilocoState, params: optax.Params
                          ) -> Any:
  """The weights to evaluate: the global fragments ``Theta`` in params
  dtypes (the syncer's model)."""
  return _local.cast_like(state.anchor, params)
