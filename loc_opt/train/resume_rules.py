"""Which config fields a checkpoint's run may change on a resume or a branch.

``loc_opt.train.checkpoint`` compares a saved config with the current one
through :func:`resume_diffs` (a resume) and :func:`branch_diffs` (a branch,
``init_from``); each difference is ``leaf.path: saved -> now``.
"""

from collections.abc import Sequence
from typing import Any

from loc_opt.train import registry

# Config fields that must match for a checkpoint to be resumable (every
# leaf under them), and the leaves under them that may change on resume.
# Every other field (logging cadence and backends, evaluation and checkpoint
# cadence, progress, halt_after_steps, init_from, wallclock) may change on
# resume.
# faults: injected NaNs, dropout and learner failures change the numbers;
# worker speeds drive async local SGD's and Decoupled DiLoCo's numerics.
_MUST_MATCH = ('model', 'mesh', 'outer', 'optimizer', 'batch_size', 'seed',
               'num_steps', 'data', 'faults', 'wallclock.worker_speeds')
# outer.overlap groups steps into programs, with the same numbers.
_RESUME_MAY_DIFFER = ('data.data_dir', 'data.eval_batch_size',
                      'faults.max_bad_steps', 'outer.overlap',
                      'faults.step_sleep_s')  # pacing, not numerics

# A branch must continue the same training problem and the same state
# layout: everything under these fields must match, except the fields of
# BRANCH_MAY_DIFFER. (Numeric optimizer hyperparameters other than the
# learning-rate schedule live in the saved state under
# optax.inject_hyperparams, so a changed value would be silently ignored;
# they must match too.)
_BRANCH_MUST_MATCH = ('model', 'mesh', 'data', 'batch_size', 'seed',
                      'outer', 'optimizer')
BRANCH_MAY_DIFFER = ('optimizer.learning_rate', 'optimizer.schedule',
                      'optimizer.schedule_kwargs', 'outer.sync_every',
                      'outer.sync_schedule', 'outer.sync_schedule_kwargs',
                      'outer.overlap')


def get_field(tree: dict[str, Any], dotted: str) -> Any:
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
    ``'field: saved -> now'`` for each differing leaf field.
  """
  exempt = tuple(may_differ)

  def allowed(field):
    return any(field == e or field.startswith(e + '.') for e in exempt)

  diffs = []
  for key in must_match:
    a, b = _flatten(get_field(saved, key), key), _flatten(get_field(current, key), key)
    for field in sorted(set(a) | set(b)):
      if not allowed(field) and a.get(field) != b.get(field):
        diffs.append(f'{field}: {a.get(field)!r} -> {b.get(field)!r}')
  return diffs


def _mesh_reason(method_name: str) -> str:
  """Why ``method_name`` cannot resume on another mesh."""
  method = registry.METHODS.get(method_name)
  if method is not None and not method.per_worker:
    return (f'outer.method={method_name!r} keeps one replicated copy of the '
            'state and does not support an elastic resume')
  return (f'outer.method={method_name!r} has no anchor shared by all '
          'workers to start new workers from (Method.elastic), so it cannot '
          'resume with another mesh; elastic: '
          f'{", ".join(n for n, m in registry.METHODS.items() if m.elastic)}')


# Fields added after runs were saved, with the value that reproduces how
# those runs behaved without them: a saved config that lacks one resumes
# when the current value is that one.
_ADDED_WITH_OLD_BEHAVIOUR = {
    'faults.chaos_chips_per_learner': 1,
    'outer.aggregate': 'mean',  # the plain mean; trim and clip unused
    'outer.aggregate_trim': 1, 'outer.aggregate_clip': 1.0,
    'outer.state_layout': 'replicated', 'mesh.simulate_workers': False,
    # The Mixture-of-Experts fields: a run saved before them was dense (its
    # rule for the logical axis 'expert' is never read by a dense model).
    'model.moe.num_experts': 0, 'model.moe.top_k': 1,
    'model.moe.capacity_factor': 1.25, 'model.moe.balance_loss': 0.01,
    'model.moe.z_loss': 0.001, 'model.moe.shared_expert': False,
    'model.moe.dispatch': 'all_to_all', 'model.axis_rules.expert': ['fsdp'],
}

# The faults fields only a method with a timeline (Method.step_inputs)
# reads; the others refuse any value but the default (validate_config).
_TIMELINE_FAULTS = ('faults.failures', 'faults.chaos_')


def _unread_prefixes(method_name: str) -> tuple[str, ...]:
  """Config fields that ``method_name``'s run never reads: the other
  methods' sections ``outer.<section>`` and, without a timeline, the
  learner-failure fields. A difference there (e.g. a field added to
  another method's section since the run was saved) cannot change it."""
  method = registry.METHODS.get(method_name)
  own = getattr(method, 'section', None)
  out = tuple(f'outer.{m.section}.' for m in registry.METHODS.values()
              if m.section is not None and m.section != own)
  if method is not None and method.step_inputs is None:
    out += _TIMELINE_FAULTS
  return out


def resume_diffs(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
  """The differences that forbid resuming a run saved with ``saved``.

  ``num_steps`` is among them: the learning-rate (and sync) schedules are
  built from it, so a resume with another value would silently re-stretch
  them mid-run. To train longer, branch off the run with ``init_from``.

  Fields the run's method never reads (other methods' sections; the
  learner-failure fields without a timeline) may differ.

  ``outer.state_layout`` may switch between ``'replicated'`` and
  ``'offloaded'`` (the checkpoint is the same), not to or from
  ``'sharded'``.

  The ``mesh`` fields (``mesh.workers``, and the axes inside a worker) may
  differ when the method's workers share an anchor (``Method.elastic``): an
  elastic resume (``loc_opt.train.elastic``); for the other methods the
  difference says why not.
  """
  method = get_field(current, 'outer.method')
  elastic = getattr(registry.METHODS.get(method), 'elastic', False)
  may_differ = _RESUME_MAY_DIFFER + (('mesh',) if elastic else ())
  added = tuple(f'{k}: None -> {v!r}'
                for k, v in _ADDED_WITH_OLD_BEHAVIOUR.items())
  diffs = [d for d in config_diffs(saved, current, _MUST_MATCH, may_differ)
           if not d.startswith(_unread_prefixes(method)) and d not in added]
  # The replicated and the offloaded outer state are stored alike (the
  # placement is the run's): a run may switch between them on resume.
  whole = ('replicated', 'offloaded')
  if all((get_field(c, 'outer.state_layout') or 'replicated') in whole
         for c in (saved, current)):
    diffs = [d for d in diffs if not d.startswith('outer.state_layout:')]
  out = []
  for d in diffs:
    if d.startswith('num_steps:'):
      d += (' (the schedules are built for num_steps; to train longer, '
            'start a new workdir with init_from)')
    elif d.startswith('mesh.'):
      d += f' ({_mesh_reason(method)})'
    out.append(d)
  return out


def branch_diffs(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
  return config_diffs(saved, current, _BRANCH_MUST_MATCH, BRANCH_MAY_DIFFER)
