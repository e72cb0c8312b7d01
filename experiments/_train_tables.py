"""Renderers of docs/benchmarks.md's inner-optimizer, schedule and
step-time tables.

``experiments.benchmark_step_time`` (the inner step against data
parallelism, tokens/s against exogym, the CPU levers),
``experiments.profile_step``, ``experiments.spikes`` (injected gradient
spikes: final loss and steps to recover per optimizer),
``experiments.schedules`` (schedules at equal steps; three budgets from
one run) and ``experiments.inner_under_diloco`` (inner optimizers under
DiLoCo) write the results files; the setup each
caption states is read from the configs of the runs the file records
(``data['runs']``). ``experiments.tables`` renders them with these, and the
programs print their tables with them (:func:`as_written`).
"""

import json
import re
from typing import Any

from experiments import _registry

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
  if name.startswith('schedule-free adamw lr '):
    return f'schedule-free AdamW, peak lr {name.rsplit(" ", 1)[1]}'
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
  wsd = next(n for n in res['runs'] if n.startswith('wsd '))
  decay = _config(data, wsd)['optimizer']['schedule_kwargs']['decay_steps']
  other = (' unless its row names another' if any(
      n.startswith('schedule-free adamw lr ') for n in res['runs']) else '')
  lines = [
      f'{_tokens(c)}, {c["outer"]["method"]}, {o["name"]} peak '
      f'{o["learning_rate"]:g} (schedule-free: the same peak{other}), '
      f'warmup {o["schedule_kwargs"]["warmup_steps"]} steps, every decay to '
      f'0; WSD decays over the last {_share(decay)} of the run; WSM merges '
      f'checkpoints of the constant run.{_seeds_note(res)}', '',
      f'| schedule ({c["num_steps"]} steps) | final eval loss |', '|---|---|']
  losses = {_schedule_label(n): _seed_stats(res, n, r['final_eval_loss'])
            for n, r in res['runs'].items() if not _budget_run(n)}
  for shape, m in res['wsm'].items():
    coeffs = ', '.join(f'{x:.3g}' for x in m['coefficients'])
    steps = ', '.join(map(str, m['steps']))
    label = f'WSM {shape}: merge of steps {steps} with coefficients {coeffs}'
    losses[label] = (m['eval_loss'],)
  best = min(x[0] for x in losses.values())
  for label, x in losses.items():
    text = _mean_std(x)
    lines.append(f'| {label} | {f"**{text}**" if x[0] == best else text} |')
  return '\n'.join(lines) + '\n'


def seed_stats(values: list[float]) -> tuple[float, ...]:
  """``(value,)`` for one value; ``(mean, sample std, n)`` for more."""
  if len(values) < 2:
    return tuple(values)
  return (*_registry.mean_sd(values), len(values))


def _mean_std(x: tuple[float, ...]) -> str:
  return f'{x[0]:.4f}' if len(x) == 1 else (
      f'{x[0]:.4f} ± {x[1]:.4f} ({x[2]} seeds)')


def _seed_stats(res: dict[str, Any], name: str, loss: float):
  """Run ``name``'s loss over the seeds it ran at (results written with
  ``--seeds``), else ``(loss,)``."""
  per_seed = res.get('seed_losses', {}).get(name)
  return seed_stats(list(per_seed.values())) if per_seed else (loss,)


def _seeds_note(res: dict[str, Any]) -> str:
  seeds = res.get('seeds', [])
  if len(seeds) < 2:
    return ''
  return (f' Seeds {", ".join(map(str, seeds))} (model init and data order; '
          'every run of a seed reads the same batches): mean ± sample std '
          'where a run has more than one seed, else the first seed.')


def schedules_budgets(data: dict[str, Any]) -> str:
  """The loss at each budget and the steps spent: one WSD-S run, WSD
  decays branched off the constant run, one cosine run per budget."""
  res = data['results']
  runs, budgets = res['runs'], res['budgets']
  starts, branches = res['starts'], res['branches']
  cosines = ['cosine' if b == budgets[-1] else f'cosine {b}'
             for b in budgets]
  if 'wsd-s' not in runs or any(n not in runs for n in cosines):
    return 'Part 2 (WSD-S against cosine per budget) was not run.\n'
  decay = _config(data, 'wsd-s')['optimizer']['schedule_kwargs'][
      'decay_steps']
  ev = runs['wsd-s']['curve']['eval']
  at = res.get('seed_wsds') or {'': [ev[str(b)] for b in budgets]}
  wsds = [seed_stats([v[i] for v in at.values()])
          for i in range(len(budgets))]
  spent = max(starts) + sum(b - s for b, s in zip(budgets, starts))
  decays = ' + '.join(str(b - s) for b, s in zip(budgets, starts))
  first = ', '.join(map(str, budgets[:-1]))
  lines = [
      f'Budgets of {first} and {budgets[-1]} steps.' if first else
      f'A budget of {budgets[-1]} steps.', '',
      '| method | ' + ' | '.join(f'loss at {b}' for b in budgets)
      + ' | total steps spent |', '|---|' + '---|' * (len(budgets) + 1),
      f"| WSD-S, one run (`'wsds'`, each decay {_share(decay)} of its "
      'segment) | ' + ' | '.join(_mean_std(x) for x in wsds)
      + f' | {budgets[-1]} |']
  if branches:
    lines.append(
        f'| WSD, decays ({_share(decay)} of each budget) branched off the '
        'constant run with `loc_opt.train.branch_and_evaluate` | '
        + ' | '.join(f'{branches[str(b)]["final_eval_loss"]:.4f}'
                     for b in budgets)
        + f' | {spent} ({max(starts)} main + {decays}) |')
  lines += [
      '| cosine, one run per budget | ' + ' | '.join(
          _mean_std(_seed_stats(res, n, runs[n]['final_eval_loss']))
          for n in cosines) + f' | {sum(budgets)} |']
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
        f'{_registry.format_bytes(r["cross_worker_bytes"])} | {r["syncs"]} | '
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


def step_time_main(data: dict[str, Any]) -> str:
  """DiLoCo's inner step against a data-parallel step."""
  r = data['results']['step_time']
  med, nbytes = r['median_step_s'], r['cross_worker_bytes_per_step']
  return '\n'.join([
      f'{r["num_params"]:,} parameters on {r["devices"]} devices; '
      f'{r["steps_timed"]} steps per program, alternating blocks.', '',
      '| program | median step | cross-worker bytes / step |',
      '|---|---|---|',
      f'| data-parallel (Optax AdamW, gradients all-reduced over every '
      f'device) | {med["data_parallel"] * 1e3:.1f} ms | '
      f'{nbytes["data_parallel"]:,} |',
      f'| DiLoCo inner step (shard_map over `worker`, GSPMD inside) | '
      f'{med["diloco"] * 1e3:.1f} ms | {nbytes["diloco"]:,} |',
      f'| DiLoCo sync step | (not timed) | '
      f'{r["diloco_sync_step_bytes"]:,} |', '',
      f'Ratio DiLoCo inner / data-parallel: '
      f'**{r["ratio_diloco_inner_over_dp"]:.3f}**.']) + '\n'


# The layouts measured beside the default one: results key -> column name
# and how the caption describes the runs.
THROUGHPUT_LAYOUTS = {
    'stacked': ('loc_opt stacked on 1 device',
                'loc_opt with the workers stacked on one device'),
    'processes': ('loc_opt stacked in 2 processes',
                  'loc_opt with the workers stacked 2 per process in 2 '
                  'processes of one core each (`--local_processes=2`)'),
}


def step_time_throughput(data: dict[str, Any]) -> str:
  """Tokens/s through the launcher at issue 20's sizes (and exogym's, and
  with the workers stacked on one device, or in 2 processes, where
  measured)."""
  r = data['results']['throughput']
  exo = all('exogym' in row for row in r['sizes'].values())
  layouts = [k for k in THROUGHPUT_LAYOUTS
             if all(k in row for row in r['sizes'].values())]
  head = '| model | params | loc_opt tok/s |'
  rule = '|---|---:|---:|'
  if exo:
    head += ' exogym tok/s (its params) | loc_opt / exogym |'
    rule += '---:|---:|'
  for key in layouts:
    head += f' {THROUGHPUT_LAYOUTS[key][0]} tok/s |'
    rule += '---:|'
    if exo:
      head += f' {key} / exogym |'
      rule += '---:|'
  repeats = r.get('repeats', 1)
  order = ['loc_opt at the default layout (4 workers x 2 devices, 8 '
           'devices)'] + (['exogym'] if exo else []) + [
               THROUGHPUT_LAYOUTS[k][1] for k in layouts]
  lines = [f'4 workers, H = {r["sync_every"]}, {r["steps"]} steps per run, '
           'median of the 10-step windows after the first; '
           + ', then '.join(order)
           + (', one after another' if len(order) > 1 else '')
           + (f'; {repeats} rounds of these runs, each figure the median '
              'of its rounds' if repeats > 1 else '') + '.', '',
           head, rule]
  for label, row in r['sizes'].items():
    cells = [label, f'{row["num_params"]:,}', f'{row["tokens_per_s"]:,.0f}']
    if exo:
      e = row['exogym']
      cells += [f'{e["tokens_per_s"]:,.0f} ({e["num_params"]:,})',
                f'{row["tokens_per_s"] / e["tokens_per_s"]:.2f}']
    for key in layouts:
      cells.append(f'{row[key]["tokens_per_s"]:,.0f}')
      if exo:
        cells.append(
            f'{row[key]["tokens_per_s"] / row["exogym"]["tokens_per_s"]:.2f}')
    lines.append('| ' + ' | '.join(cells) + ' |')
  if repeats > 1 and exo:
    lines.append('')
    lines.append('Ratios to exogym round by round, default layout'
                 + ''.join(f' ({k})' for k in layouts) + ': '
                 + '; '.join(_round_ratios(label, row, layouts)
                             for label, row in r['sizes'].items()) + '.')
  return '\n'.join(lines) + '\n'


def _round_ratios(label: str, row: dict[str, Any], layouts) -> str:
  """``label a, b, c`` (and ``(x, y, z)`` for each of ``layouts``): each
  round's loc_opt tokens/s over the same round's exogym tokens/s."""
  exo = row['exogym']['rounds_tokens_per_s']
  text = f'{label} ' + ', '.join(
      f'{a / e:.2f}' for a, e in zip(row['rounds_tokens_per_s'], exo))
  for key in layouts:
    text += ' (' + ', '.join(
        f'{a / e:.2f}' for a, e in
        zip(row[key]['rounds_tokens_per_s'], exo)) + ')'
  return text


def step_ab_main(data: dict[str, Any]) -> str:
  """Config variants of the inner step, timed alternately in one process
  (``experiments.step_ab``); speed against the first variant."""
  r = data['results']
  variants = r['variants']
  first = next(iter(variants.values()))['median_step_s']
  mesh = r['mesh']
  layout = (f'{mesh["workers"]} workers stacked on each of '
            f'{r["cpu_devices"]} CPU device(s)' if mesh.get('simulate_workers')
            else f'{mesh["workers"]} workers x {mesh["data"]} devices')
  sizes = ', '.join(f'{k} {v}' for k, v in r['model_sizes'].items()
                    if v is not None)
  lines = [f'{r["model"]} ({sizes}), {layout}; {r["rounds"]} rounds of '
           f'{r["block"]}-step blocks, alternating, in one process.', '',
           '| variant | overrides | median step | tok/s | speed vs first |',
           '|---|---|---:|---:|---:|']
  for name, v in variants.items():
    overrides = ', '.join(f'`{k}={x}`' for k, x in v['overrides'].items())
    lines.append(f'| {name} | {overrides or "-"} | '
                 f'{v["median_step_s"] * 1e3:.1f} ms | '
                 f'{v["tokens_per_s"]:,.0f} | '
                 f'{first / v["median_step_s"]:.3f} |')
  return '\n'.join(lines) + '\n'


def step_time_levers(data: dict[str, Any]) -> str:
  """Tokens/s of the 853k model under each CPU lever."""
  r = data['results']['throughput']
  levers = r['levers']
  if not levers:
    return 'No levers measured.\n'
  base = next(iter(levers.values()))['tokens_per_s']
  lines = [f'The {r["lever_size"]} model; each run as in the table above.',
           '', '| lever | XLA_FLAGS / arguments | tok/s | vs first row |',
           '|---|---|---:|---:|']
  for name, row in levers.items():
    # The lever's own arguments: devices, processes, mesh, host memory and
    # model fields other than the size (num_layers, d_model), which every
    # row shares.
    extra = [a for a in row['args'] if a.startswith(
        ('--cpu_devices', '--local_processes', '--config.mesh',
         '--config.model', '--reuse_host_memory'))
             and not a.startswith(('--config.model.num_layers',
                                   '--config.model.d_model'))]
    how = ', '.join(f'`{x}`' for x in [row['xla_flags']] + extra if x)
    lines.append(f'| {name} | {how or "-"} | {row["tokens_per_s"]:,.0f} | '
                 f'{row["tokens_per_s"] / base:.2f} |')
  return '\n'.join(lines) + '\n'


def benchmark_step_time_all(data: dict[str, Any]) -> str:
  """Every part that ran, as the benchmark prints it."""
  parts = []
  if 'step_time' in data['results']:
    parts.append(step_time_main(data))
  if 'throughput' in data['results']:
    parts += [step_time_throughput(data), step_time_levers(data)]
  return '\n'.join(parts)


_registry.tables({
    ('benchmark_step_time', 'main'): step_time_main,
    ('benchmark_step_time', 'throughput'): step_time_throughput,
    ('benchmark_step_time', 'levers'): step_time_levers,
    ('step_ab_853k', 'main'): step_ab_main,
    ('step_ab_1480k', 'main'): step_ab_main,
    ('profile_step', 'main'): profile_step_main,
    ('spikes', 'main'): spikes_main,
    ('schedules', 'main'): schedules_main,
    ('schedules', 'budgets'): schedules_budgets,
    ('schedules_budget', 'main'): schedules_main,
    ('schedules_budget', 'budgets'): schedules_budgets,
    ('inner_under_diloco', 'main'): inner_under_diloco_main,
})
