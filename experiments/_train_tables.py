"""Renderers of docs/benchmarks.md's inner-optimizer and schedule tables.

``experiments.spikes`` (injected gradient spikes: final loss and steps to
recover per optimizer), ``experiments.schedules`` (schedules at equal
steps; three budgets from one run) and ``experiments.inner_under_diloco``
(inner optimizers under DiLoCo) write the results files; the setup each
caption states is read from the configs of the runs the file records
(``data['runs']``). ``experiments.tables`` renders them with these, and the
programs print their tables with them (:func:`as_written`).
"""

import json
import re
from typing import Any

# The spikes benchmark's default recovery band (its --tolerance), read back
# from the results file's command line when that names none.
SPIKE_TOLERANCE = 0.02

# Names in loc_opt.inner.OPTIMIZERS -> how the tables write them (others
# as they are).
_OPTIMIZERS = {'adamw': 'AdamW', 'spam': 'SPAM', 'stable_spam': 'Stable-SPAM',
               'swan': 'SWAN'}


def as_written(results: Any, runs: Any, command: Any = ()) -> dict[str, Any]:
  """``results``, ``runs`` (``experiments._runs.RUNS``) and ``command`` as
  a results file holds them (JSON: integer keys become strings), for a
  program to print its table with the renderer that renders its file."""
  return json.loads(json.dumps({'command': list(command), 'runs': runs,
                                'results': results}, default=str))


def _label(name: str) -> str:
  return _OPTIMIZERS.get(name, name)


def _config(data: dict[str, Any], label: str) -> dict[str, Any]:
  """The config of the run labelled ``label`` in ``data['runs']``."""
  for run in data.get('runs', []):
    if run['label'] == label:
      return run['config']
  raise KeyError(f'no run {label!r} in the results file; runs: '
                 f'{[r["label"] for r in data.get("runs", [])]}')


def _flag(data: dict[str, Any], name: str, default: float) -> float:
  """``--name`` of the results file's command line, else ``default``."""
  args, value = data.get('command', []), default
  for i, arg in enumerate(args):
    if arg.startswith(f'--{name}='):
      value = arg.split('=', 1)[1]
    elif arg == f'--{name}' and i + 1 < len(args):
      value = args[i + 1]
  return float(value)


def _tokens(c: dict[str, Any]) -> str:
  return (f'{c["num_steps"]} steps x {c["batch_size"]} x '
          f'{c["data"]["seq_len"]} bytes')


def _clip(c: dict[str, Any]) -> str:
  clip = c['optimizer']['grad_clip_norm']
  return f'global-norm clip {clip:g}' if clip else 'no gradient clipping'


def _bold_best(losses: dict[str, float], among: list[str]) -> dict[str, str]:
  """``name -> '1.2345'``, the lowest of ``among`` in bold."""
  best = min((losses[n] for n in among), default=None)
  return {n: (f'**{x:.4f}**' if n in among and x == best else f'{x:.4f}')
          for n, x in losses.items()}


def spikes_main(data: dict[str, Any]) -> str:
  """Final eval loss and the steps to recover from each spike, (a) to the
  pre-spike loss and (b) to the no-spike run, per optimizer; the best
  spiked run in bold."""
  res = data['results']
  runs, spikes = res['runs'], res['spikes']
  spiked = [n for n in runs if not n.endswith(' (no spikes)')]
  c = _config(data, spiked[0])
  o = c['optimizer']
  tol = _flag(data, 'tolerance', SPIKE_TOLERANCE)
  lines = [
      f'{_tokens(c)}, {c["outer"]["method"]}, peak lr '
      f'{o["learning_rate"]:g} ({o["schedule"]}), {_clip(c)}; '
      f'{o["spike_scale"]:g}x gradient on updates {spikes} (seed '
      f'{o["spike_seed"]}). Steps to recover: updates after the spike until '
      f'the forward 5-step mean train loss is within {tol:.0%} of (a) the '
      'mean train loss of the 10 steps before it, (b) the no-spike run\'s '
      'forward 5-step mean at the same steps; `> n`: not before the next '
      'spike or the end.', '',
      '| optimizer | final eval loss | ' + ' | '.join(
          ('recover, ' if i == 0 else '') + f'spike at {k}: (a) / (b)'
          for i, k in enumerate(spikes)) + ' |',
      '|---|---|' + '---|' * len(spikes)]
  loss = _bold_best({n: r['final_eval_loss'] for n, r in runs.items()},
                    spiked)
  for name, r in runs.items():
    if name in spiked:
      label = _label(name)
      cells = [f'{a} / {b}' for a, b in zip(r['recovery'],
                                            r['recovery_vs_reference'])]
    else:
      label = f'{_label(name[:-len(" (no spikes)")])}, no spikes (reference)'
      cells = ['-'] * len(spikes)
    lines.append(f'| {label} | {loss[name]} | ' + ' | '.join(cells) + ' |')
  return '\n'.join(lines) + '\n'


def _share(steps: float) -> str:
  """A decay length as the schedules take it: a float below 1 is a
  fraction, anything else steps."""
  return f'{steps:.0%}' if isinstance(steps, float) and steps < 1 else (
      f'{steps:g} steps')


def _schedule_label(name: str) -> str:
  if name.startswith('wsd '):
    return f'WSD, {name[4:]} decay'
  return {'schedule-free adamw': 'schedule-free AdamW',
          'constant (wsd main)': 'constant after warmup (the WSD main run, '
                                 'no decay)'}.get(name, name)


def _budget_run(name: str) -> bool:
  """Whether run ``name`` of the schedules benchmark is one of part 2's."""
  return name == 'wsd-s' or re.fullmatch(r'cosine \d+', name) is not None


def schedules_main(data: dict[str, Any]) -> str:
  """Final eval loss of every schedule at equal steps and of the WSM
  merges of the constant run; the best in bold."""
  res = data['results']
  c = _config(data, 'cosine')
  o = c['optimizer']
  decay = _config(data, 'wsd linear')['optimizer']['schedule_kwargs'][
      'decay_steps']
  lines = [
      f'{_tokens(c)}, {c["outer"]["method"]}, {o["name"]} peak '
      f'{o["learning_rate"]:g} (schedule-free: the same peak), warmup '
      f'{o["schedule_kwargs"]["warmup_steps"]} steps, every decay to 0; '
      f'WSD decays over the last {_share(decay)} of the run; WSM merges '
      'checkpoints of the constant run.', '',
      f'| schedule ({c["num_steps"]} steps) | final eval loss |', '|---|---|']
  losses = {_schedule_label(n): r['final_eval_loss']
            for n, r in res['runs'].items() if not _budget_run(n)}
  for shape, m in res['wsm'].items():
    coeffs = ', '.join(f'{x:.3g}' for x in m['coefficients'])
    steps = ', '.join(map(str, m['steps']))
    label = f'WSM {shape}: merge of steps {steps} with coefficients {coeffs}'
    losses[label] = m['eval_loss']
  for label, text in _bold_best(losses, list(losses)).items():
    lines.append(f'| {label} | {text} |')
  return '\n'.join(lines) + '\n'


def schedules_budgets(data: dict[str, Any]) -> str:
  """The loss at each budget and the steps spent: one WSD-S run, WSD
  decays branched off the constant run, one cosine run per budget."""
  res = data['results']
  runs, budgets = res['runs'], res['budgets']
  starts, branches = res['starts'], res['branches']
  decay = _config(data, 'wsd-s')['optimizer']['schedule_kwargs'][
      'decay_steps']
  ev = runs['wsd-s']['curve']['eval']
  cosines = [runs['cosine' if b == budgets[-1] else f'cosine {b}']
             for b in budgets]
  spent = max(starts) + sum(b - s for b, s in zip(budgets, starts))
  decays = ' + '.join(str(b - s) for b, s in zip(budgets, starts))
  first = ', '.join(map(str, budgets[:-1]))
  lines = [
      f'Budgets of {first} and {budgets[-1]} steps.' if first else
      f'A budget of {budgets[-1]} steps.', '',
      '| method | ' + ' | '.join(f'loss at {b}' for b in budgets)
      + ' | total steps spent |', '|---|' + '---|' * (len(budgets) + 1),
      f"| WSD-S, one run (`'wsds'`, each decay {_share(decay)} of its "
      'segment) | ' + ' | '.join(f'{ev[str(b)]:.4f}' for b in budgets)
      + f' | {budgets[-1]} |',
      f'| WSD, decays ({_share(decay)} of each budget) branched off the '
      'constant run with `loc_opt.train.branch_and_evaluate` | '
      + ' | '.join(f'{branches[str(b)]["final_eval_loss"]:.4f}'
                   for b in budgets)
      + f' | {spent} ({max(starts)} main + {decays}) |',
      '| cosine, one run per budget | ' + ' | '.join(
          f'{r["final_eval_loss"]:.4f}' for r in cosines)
      + f' | {sum(budgets)} |']
  return '\n'.join(lines) + '\n'


def _inner_label(name: str, r: dict[str, Any]) -> str:
  if 'settings' not in r:  # A reference run, e.g. 'data-parallel adamw'.
    method, _, opt = name.rpartition(' ')
    return f'{method} {_label(opt)} (reference)'.lstrip()
  whitening = r['settings']['kwargs'].get('whitening')
  return _label(name) + (f' ({whitening} whitening)' if whitening else '')


def _train_time(data: dict[str, Any], name: str, r: dict[str, Any]) -> str:
  """Seconds of the training loop of run ``name``, from the record of the
  process that trained it (a run read back has 0 in its summary); the step
  it resumed from, if it did."""
  record = next((run['provenance'] for run in data.get('runs', [])
                 if run['label'] in (f'diloco + {name}', name)), {})
  secs = record.get('train_seconds')
  if secs is None:
    secs = r.get('train_seconds_this_run')
  if secs is None:
    return '-'
  resumed = record.get('resumed_from_step')
  return f'{secs:.0f}' + (f' (resumed at step {resumed})' if resumed
                          else '')


def inner_under_diloco_main(data: dict[str, Any]) -> str:
  """Final eval loss, cross-worker bytes, syncs and train time per inner
  optimizer under DiLoCo (the best in bold) and of the reference run."""
  from experiments import tables  # pylint: disable=g-import-not-at-top
  runs = data['results']
  inner = [n for n, r in runs.items() if 'settings' in r]
  c = _config(data, f'diloco + {inner[0]}')
  o, out = c['optimizer'], c['outer']
  lines = [
      f'{_tokens(c)}, {c["mesh"]["workers"]} workers x {c["mesh"]["data"]} '
      f'devices, H = {out["sync_every"]}, outer '
      f'{"Nesterov" if out["nesterov"] else "heavy-ball"} lr '
      f'{out["learning_rate"]:g} momentum {out["momentum"]:g}; inner peak lr '
      f'{o["learning_rate"]:g} ({o["schedule"]}), {_clip(c)}. Train time: '
      'the training loop of the process that trained the run.', '',
      '| inner optimizer | final eval loss | cross-worker bytes | syncs | '
      'train time (s) |', '|---|---|---|---|---|']
  loss = _bold_best({n: r['final_eval_loss'] for n, r in runs.items()},
                    inner)
  for name, r in runs.items():
    lines.append(
        f'| {_inner_label(name, r)} | {loss[name]} | '
        f'{tables.format_bytes(r["cross_worker_bytes"])} | {r["syncs"]} | '
        f'{_train_time(data, name, r)} |')
  return '\n'.join(lines) + '\n'


def profile_step_main(data: dict[str, Any]) -> str:
  """Where the stacked inner step's time goes on one core, by category
  (``experiments.profile_step``)."""
  r = data['results']
  sizes = r['sizes']
  names = list(sizes)
  lines = [
      f'4 workers stacked on one CPU device, one core. Each category: its '
      f'ops\' time per step in a `jax.profiler` trace of {r["steps"]} steps '
      f'(time in which two ops ran at once shared between them) and its '
      f'share of the traced step; matmul rows also give their GFLOP/s.', '',
      '| | ' + ' | '.join(f'{n} ({sizes[n]["num_params"]:,} params)'
                          for n in names) + ' |',
      '|---|' + '---:|' * len(names)]

  def row(label, cells):
    lines.append(f'| {label} | ' + ' | '.join(cells) + ' |')

  row('step on 1 core', [f'{sizes[n]["median_step_ms"]:.1f} ms'
                         for n in names])
  row('step on 1 core, traced', [f'{sizes[n]["traced_step_ms"]:.1f} ms'
                                 for n in names])
  row(f'step on {sizes[names[0]]["all_cpus"]} cores',
      [f'{sizes[n]["all_cpus_median_step_ms"]:.1f} ms' for n in names])
  for category in r['categories']:
    cells = []
    for n in names:
      c = sizes[n]['categories'][category]
      cell = f'{c["ms"]:.1f} ms ({100 * c["ms"] / sizes[n]["traced_step_ms"]:.0f}%)'
      if c['gflop']:
        cell += f', {c["gflop"] / c["ms"] * 1e3:.0f} GFLOP/s'
      cells.append(cell)
    row(category, cells)
  row('matmul GFLOP per step', [
      f'{sum(c["gflop"] for c in sizes[n]["categories"].values()):.1f}'
      for n in names])
  row('outside ops (dispatch, host)', [
      f'{sizes[n]["traced_step_ms"] - sum(c["ms"] for c in sizes[n]["categories"].values()):.1f} ms'
      for n in names])
  row('a lone matmul of the MLP\'s shape', [
      f'{sizes[n]["lone_matmul_gflops"]:.0f} GFLOP/s' for n in names])
  return '\n'.join(lines) + '\n'
