r"""Goodput under chip failures: Table 1 of Decoupled DiLoCo, in shape.

Plays one failure trace per chip count (``loc_opt.parallel.goodput``: each
chip interrupted once per ``--mtbi_years`` on average, one slice down per
interruption) against non-elastic data parallel, elastic data parallel,
synchronous DiLoCo and Decoupled DiLoCo with ``M`` learners, over the
paper's chip counts, and prints the goodput table next to the paper's.

The paper gives no restart, downscale or upscale times (per the 2nd-hand
sources read), so with ``--fit`` (the default) they are fitted to the
paper's two data-parallel rows only: the restart time (and checkpoint
interval, from ``--fit_checkpoints``) of non-elastic DP to its row, then one
reconfiguration time (downscale = upscale, an assumption) of elastic DP to
its row, each by least squares in percentage points (golden-section search
on the same seeded traces). Everything else (slice size, slice recovery
time, step time, ``H``) is assumed, not fitted. The Decoupled DiLoCo rows
are then predictions, compared with the paper's; the table also tests the
rule of thumb (``M`` learners on ``N`` chips ~ elastic DP on ``N / M``
chips) in our simulation and in the paper's numbers.

That Decoupled DiLoCo row is a renewal model (every step of a live learner
counts: ``M`` elastic jobs on ``N / M`` chips), so it is an upper bound.
Beside it (``--measure``, the default) goodput is measured on the
Decoupled DiLoCo driver's own timeline
(``loc_opt.outer.simulate_timeline``:
``loc_opt.outer.decoupled_timeline`` under the chaos model, with the same
failure rate and the fitted pauses as each learner's downtime): work of
learners not admitted to a merge, work overwritten between a merge and its
arrival and unmerged work lost at a rejoin do not count, and the table
shows where the time went.

The paper's numbers are second-hand (a digest of Douillard et al.,
*Decoupled DiLoCo for Resilient Distributed Pre-training*, arXiv
2604.21428, 2026, Table 1; ``/work/shared/specs/frontier-2026.md`` 1.7).

  python -m experiments.goodput                 # prints the tables
  python -m experiments.goodput --workdir=docs/results \
    --figure=docs/figures/goodput.png

Prints the tables; with --workdir also writes ``goodput.md`` and
``goodput.json`` there, and the figure (goodput against chips, and against
chips per learner) to --figure (default ``<workdir>/goodput.png``; skipped,
with one line, when matplotlib is not installed or neither flag is given).
A few minutes on one core (the measured timelines take most of it).
"""

import dataclasses
import math
import pathlib
import sys
import time

import numpy as np
from absl import app, flags

from experiments import _runs
from loc_opt import outer
from loc_opt.parallel import goodput

_WORKDIR = flags.DEFINE_string('workdir', None, 'Where results go (none: '
                                'print only).')
_FIGURE = flags.DEFINE_string('figure', None,
                              'Figure path (default <workdir>/goodput.png).')
_CHIPS = flags.DEFINE_list('chips', ['150000', '300000', '600000', '1200000',
                                     '2400000'], 'Chip counts N.')
_LEARNERS = flags.DEFINE_list('learners', ['1', '2', '4', '8', '16'],
                              'Learner counts M.')
_HORIZON = flags.DEFINE_float('horizon_days', 7.0, 'Simulated days per run.')
_SEED = flags.DEFINE_integer('seed', 0, 'Seed of the failure traces.')
_FIT = flags.DEFINE_bool('fit', True, 'Fit the restart and reconfiguration '
                         'times to the paper\'s DP rows.')
_FIT_CHECKPOINTS = flags.DEFINE_list(
    'fit_checkpoints', ['0', '15', '30', '60', '120'],
    'Checkpoint intervals (s) tried when fitting the non-elastic DP row.')
_MTBI = flags.DEFINE_float('mtbi_years', 1.0, 'Per-chip MTBI, years.')
_SLICE = flags.DEFINE_integer('slice_size', 64, 'Chips per failure.')
_RECOVERY = flags.DEFINE_float('recovery_s', 1800.0, 'Slice back after (s).')
_RESTART = flags.DEFINE_float('restart_s', 90.0, 'Non-elastic restart (s), '
                              'when not fitted.')
_CHECKPOINT = flags.DEFINE_float('checkpoint_every_s', 0.0, 'Checkpoint '
                                 'interval (s), when not fitted.')
_DOWNSCALE = flags.DEFINE_float('downscale_s', 15.0, 'Downscale pause (s), '
                                'when not fitted.')
_UPSCALE = flags.DEFINE_float('upscale_s', 15.0, 'Upscale pause (s), when '
                              'not fitted.')
_STEP = flags.DEFINE_float('step_s', 1.0, 'Seconds per step.')
_SYNC_EVERY = flags.DEFINE_integer('sync_every', 24, 'Synchronous DiLoCo H.')
_SYNC = flags.DEFINE_float('sync_s', 0.0, 'Blocking sync time (s).')
_OVERLAP = flags.DEFINE_enum('overlap', 'fold', ['fold', 'extend'],
                             'Events during a pause: fold or extend.')
_MEASURE = flags.DEFINE_bool('measure', True, 'Also measure goodput on the '
                             'Decoupled DiLoCo driver\'s timeline.')
_TIMELINE_STEPS = flags.DEFINE_integer('timeline_steps', 20_000, 'Ticks '
                                       '(steps) per measured timeline.')
_TIMELINE_H = flags.DEFINE_integer('timeline_sync_every', 24, 'Measured: H.')
_TIMELINE_P = flags.DEFINE_integer('timeline_fragments', 24, 'Measured: P.')
_TIMELINE_K = flags.DEFINE_integer('timeline_quorum', 1, 'Measured: K.')
_TIMELINE_GRACE = flags.DEFINE_float('timeline_grace', 0.2, 'Measured: the '
                                     'grace factor gamma.')

# Table 1 of the paper, goodput (%) at 150k/300k/600k/1.2M/2.4M chips, 1-year
# per-chip MTBI; 2nd-hand (a digest), not checked against the paper itself.
PAPER_CHIPS = (150_000, 300_000, 600_000, 1_200_000, 2_400_000)
PAPER = {
    'dp': (72, 57, 38, 27, 18),
    'elastic_dp': (88, 80, 69, 58, 40),
    'decoupled/2': (94, 88, 80, 70, 54),
    'decoupled/4': (96, 93, 89, 82, 73),
    'decoupled/8': (98, 96, 94, 88, 80),
    'decoupled/16': (99, 98, 96, 93, 86),
}
LABELS = {'dp': 'DP, no elasticity', 'elastic_dp': 'elastic DP',
          'decoupled': 'Decoupled DiLoCo', 'diloco': 'synchronous DiLoCo'}


def _label(row: str) -> str:
  policy, _, m = row.partition('/')
  return LABELS[policy] + (f', M={m}' if m else '')


def _paper(row: str, chips: int) -> float | None:
  if row in PAPER and chips in PAPER_CHIPS:
    return float(PAPER[row][PAPER_CHIPS.index(chips)])
  return None


def _row(policy, m, chips, a, horizon, seed):
  return [goodput.simulate(policy, n, m, a, horizon_s=horizon, seed=seed)
          for n in chips]


def _rms(results, row, chips) -> float:
  diffs = [100 * r.goodput - _paper(row, n) for r, n in zip(results, chips)
           if _paper(row, n) is not None]
  return math.sqrt(sum(d * d for d in diffs) / len(diffs))


def _golden(f, lo: float, hi: float, iters: int = 22) -> float:
  """The minimizer of a unimodal ``f`` on ``[lo, hi]``."""
  ratio = (math.sqrt(5) - 1) / 2
  a, b = lo, hi
  c, d = b - ratio * (b - a), a + ratio * (b - a)
  fc, fd = f(c), f(d)
  for _ in range(iters):
    if fc < fd:
      b, d, fd = d, c, fc
      c = b - ratio * (b - a)
      fc = f(c)
    else:
      a, c, fc = c, d, fd
      d = a + ratio * (b - a)
      fd = f(d)
  return (a + b) / 2


def fit(a: goodput.Assumptions, chips, horizon, seed):
  """Restart time and checkpoint interval on the DP row, then one
  reconfiguration time (downscale = upscale) on the elastic DP row."""
  def dp_error(restart, every):
    b = dataclasses.replace(a, restart_s=restart, checkpoint_every_s=every)
    return _rms(_row('dp', 1, chips, b, horizon, seed), 'dp', chips)

  tried = []
  for every in map(float, _FIT_CHECKPOINTS.value):
    restart = _golden(lambda r, e=every: dp_error(r, e), 0.0, 600.0)
    tried.append((dp_error(restart, every), restart, every))
  dp_rms, restart, every = min(tried)

  def elastic_error(pause):
    b = dataclasses.replace(a, downscale_s=pause, upscale_s=pause)
    return _rms(_row('elastic_dp', 1, chips, b, horizon, seed),
                'elastic_dp', chips)

  pause = _golden(elastic_error, 0.0, 300.0)
  fitted = dataclasses.replace(a, restart_s=restart, checkpoint_every_s=every,
                               downscale_s=pause, upscale_s=pause)
  info = {'dp_rms_points': dp_rms, 'elastic_dp_rms_points':
          elastic_error(pause), 'tried_checkpoints': [
              {'checkpoint_every_s': e, 'restart_s': r, 'rms_points': err}
              for err, r, e in tried]}
  return fitted, info


def simulate_table(a, chips, learners, horizon, seed):
  """``{row: [Result per chip count]}`` for every policy and M."""
  table = {'dp': _row('dp', 1, chips, a, horizon, seed),
           'elastic_dp': _row('elastic_dp', 1, chips, a, horizon, seed)}
  for m in learners:
    table[f'decoupled/{m}'] = _row('decoupled', m, chips, a, horizon, seed)
  for m in learners:
    if m > 1:  # one synchronous learner is elastic DP
      table[f'diloco/{m}'] = _row('diloco', m, chips, a, horizon, seed)
  return table


def measure_table(a, chips, learners, seed):
  """``{M: [TimelineGoodput per chip count]}``: goodput measured on the
  Decoupled DiLoCo driver's timeline under the chaos model."""
  return {m: [outer.simulate_timeline(
      n, m, a, num_steps=_TIMELINE_STEPS.value,
      sync_every=_TIMELINE_H.value, num_fragments=_TIMELINE_P.value,
      quorum=min(_TIMELINE_K.value, m), grace=_TIMELINE_GRACE.value,
      seed=seed) for n in chips] for m in learners}


def measured_markdown(measured, table, chips) -> list[str]:
  """The measured goodput beside the renewal model's upper bound, and where
  the time went."""
  head = ' | '.join(_chip_label(n) for n in chips)
  lines = [('**Decoupled DiLoCo measured on its driver\'s timeline** '
            '(goodput %, measured / renewal-model upper bound; '
            f'{_TIMELINE_STEPS.value} steps of a chaos failure trace per '
            f'cell, H = {_TIMELINE_H.value}, P = {_TIMELINE_P.value}, '
            f'K = {_TIMELINE_K.value}, grace {_TIMELINE_GRACE.value:g}):'),
           '', f'| M | {head} |', '|---|' + '---:|' * len(chips)]
  for m, cells in measured.items():
    bound = table.get(f'decoupled/{m}')
    row = [f'{100 * g.goodput:.0f}' + (
        f' / {100 * bound[i].goodput:.0f}' if bound else '')
           for i, g in enumerate(cells)]
    lines.append(f'| {m} | ' + ' | '.join(row) + ' |')
  lines += ['', ('**Where the learner time went** (% of allocated, '
                 'measured): useful, overwritten by an arriving fragment '
                 '(not admitted, or stepped between a merge and its '
                 'arrival), lost at a rejoin, down, idle; merges, skipped '
                 'rounds, learners per merge, ticks from a round\'s opening '
                 'to its merge deadline:'), '',
            ('| M | N | useful | overwritten | lost at rejoin | down | idle | '
             'merges | skipped | per merge | wait |'),
            '|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|']
  for m, cells in measured.items():
    for n, g in zip(chips, cells):
      lines.append(
          f'| {m} | {_chip_label(n)} | {100 * g.goodput:.1f} | '
          f'{100 * g.discarded:.1f} | {100 * g.lost_rejoin:.1f} | '
          f'{100 * g.down:.1f} | {100 * g.idle:.1f} | {g.merges} | '
          f'{g.skipped} | {g.mean_admitted:.2f} | {g.mean_wait:.2f} |')
  return lines


def rule_of_thumb(table, chips, learners, a, horizon, seed):
  """Per (M, N): Decoupled's goodput and elastic DP's on N / M chips, ours
  (simulated) and the paper's (where N / M is one of its columns)."""
  out = []
  for m in learners:
    if m == 1:
      continue
    for n, r in zip(chips, table[f'decoupled/{m}']):
      small = goodput.simulate('elastic_dp', n // m, 1, a, horizon_s=horizon,
                               seed=seed + 1)
      paper = _paper(f'decoupled/{m}', n)
      paper_small = _paper('elastic_dp', n // m)
      out.append({'learners': m, 'chips': n, 'chips_per_learner': n // m,
                  'decoupled': r.goodput, 'elastic_dp_at_n_over_m':
                  small.goodput, 'paper_decoupled': paper,
                  'paper_elastic_dp_at_n_over_m': paper_small})
  return out


def _fmt(x, sign=''):
  return '' if x is None else f'{x:{sign}.0f}'


def _grid(rows, chips, value, title, sign=''):
  head = ' | '.join(_chip_label(n) for n in chips)
  lines = [title, '', f'| policy | {head} |',
           '|---|' + '---:|' * len(chips)]
  for row in rows:
    cells = ' | '.join(_fmt(value(row, i, n), sign)
                       for i, n in enumerate(chips))
    lines.append(f'| {_label(row)} | {cells} |')
  return lines


def _differences(table, chips):
  """Ours minus the paper's, in points, per row of the paper's table."""
  out = {}
  for row in PAPER:
    if row in table:
      out[row] = [None if _paper(row, n) is None else
                  100 * r.goodput - _paper(row, n)
                  for r, n in zip(table[row], chips)]
  return out


def _max_abs(diffs, rows):
  values = [abs(d) for row in rows if row in diffs for d in diffs[row]
            if d is not None]
  return max(values) if values else None


def markdown(table, chips, a, fitted, info, diffs, thumb, command,
             measured=None) -> str:
  """The report: our table, the paper's, differences, rule of thumb."""
  title = (f'Goodput (%) under chip failures, per-chip MTBI '
           f'{a.mtbi_s / goodput.YEAR_S:g} year(s), {_HORIZON.value:g} '
           f'simulated days per cell, seed {_SEED.value}.')
  lines = [title, '', f'Command: `{command}`', '']
  lines += _grid(table, chips, lambda r, i, n: 100 * table[r][i].goodput,
                 '**Ours** (goodput %; the Decoupled DiLoCo rows are a '
                 'renewal model, an upper bound):') + ['']
  if measured:
    lines += measured_markdown(measured, table, chips) + ['']
  lines += _grid(PAPER, chips, lambda r, i, n: _paper(r, n),
                 '**Paper, Table 1** (2nd-hand, digest):') + ['']
  lines += _grid(diffs, chips, lambda r, i, n: diffs[r][i],
                 '**Ours minus paper** (points):', sign='+') + ['']
  fit_rows = ('dp', 'elastic_dp')
  pred_rows = [r for r in diffs if r not in fit_rows]
  how = 'fitted' if fitted else 'not fitted'
  lines += [(f'Max |difference|: {_fmt(_max_abs(diffs, fit_rows))} points on '
             f'the rows the times were {how} on (DP, elastic DP); '
             f'{_fmt(_max_abs(diffs, pred_rows))} points on the Decoupled '
             'DiLoCo rows, which are predictions.'), '']
  lines += _grid(table, chips, lambda r, i, n: 100 * table[r][i].uptime,
                 '**Ours, uptime** (% of time at least one learner steps):')
  lines += ['', ('**Rule of thumb** (M learners on N chips vs elastic DP on '
                 'N/M chips, goodput %):'), '',
            ('| M | N | N/M | ours: Decoupled | ours: elastic DP at N/M | '
             'paper: Decoupled | paper: elastic DP at N/M |'),
            '|---:|---:|---:|---:|---:|---:|---:|']
  for t in thumb:
    lines.append(f'| {t["learners"]} | {t["chips"]} | '
                 f'{t["chips_per_learner"]} | {100 * t["decoupled"]:.1f} | '
                 f'{100 * t["elastic_dp_at_n_over_m"]:.1f} | '
                 f'{_fmt(t["paper_decoupled"])} | '
                 f'{_fmt(t["paper_elastic_dp_at_n_over_m"])} |')
  ours = max(abs(t['decoupled'] - t['elastic_dp_at_n_over_m']) for t in thumb)
  theirs = [abs(t['paper_decoupled'] - t['paper_elastic_dp_at_n_over_m'])
            for t in thumb if t['paper_decoupled'] is not None
            and t['paper_elastic_dp_at_n_over_m'] is not None]
  lines += ['', (f'Rule of thumb, max |difference|: ours {100 * ours:.1f} '
                 f'points; the paper\'s '
                 f'{_fmt(max(theirs) if theirs else None)} points.'), '',
            'Assumptions' + (' (restart, checkpoint, downscale = upscale '
                             'fitted):' if fitted else ':'), '']
  lines += [f'- `{k}` = {v}' for k, v in dataclasses.asdict(a).items()]
  if fitted:
    lines += ['', (f'Fit: DP row RMS {info["dp_rms_points"]:.2f} points, '
                   f'elastic DP row RMS {info["elastic_dp_rms_points"]:.2f} '
                   'points.')]
  return '\n'.join(lines) + '\n'


def _chip_label(n: int) -> str:
  return f'{n / 1000:g}k' if n < 10**6 else f'{n / 1e6:g}M'


def plot(table, chips, learners, a, horizon, seed, path):
  """Goodput against chips, and against chips per learner; one color per M
  (Decoupled solid, synchronous DiLoCo dotted, the paper's circles).
  Skipped, with one line, without matplotlib."""
  try:
    import matplotlib  # pylint: disable=g-import-not-at-top
  except ImportError:
    print(f'matplotlib is not installed: figure {path} skipped')
    return
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.8))
  cycle = plt.rcParams['axes.prop_cycle'].by_key()['color']
  color = {m: cycle[(i + 1) % len(cycle)] for i, m in enumerate(learners)}
  paper_row = {1: 'elastic_dp', **{m: f'decoupled/{m}' for m in learners
                                   if m > 1}}
  left.plot(chips, [100 * r.goodput for r in table['dp']], '-', color='k',
            label=_label('dp'))
  left.plot(PAPER_CHIPS, PAPER['dp'], 'o', color='k', mfc='none')
  for m in learners:
    row = paper_row[m]
    left.plot(chips, [100 * r.goodput for r in table[row]], '-',
              color=color[m], label=_label(row) + (' (= Decoupled, M=1)'
                                                   if m == 1 else ''))
    if row in PAPER:
      left.plot(PAPER_CHIPS, PAPER[row], 'o', color=color[m], mfc='none')
    if f'diloco/{m}' in table:
      left.plot(chips, [100 * r.goodput for r in table[f'diloco/{m}']], ':',
                color=color[m], label=_label(f'diloco/{m}'))
  left.set(xscale='log', xlabel='chips N', ylabel='goodput (%)',
           title='lines: ours; circles: paper Table 1 (2nd-hand)')
  left.set_xticks(chips, [_chip_label(n) for n in chips])
  left.minorticks_off()
  left.legend(fontsize=7)
  small = sorted({n // m for n in chips for m in learners})
  curve = [goodput.simulate('elastic_dp', n, 1, a, horizon_s=horizon,
                            seed=seed + 1).goodput for n in small]
  right.plot(small, 100 * np.asarray(curve), 'k-', lw=1,
             label='ours: elastic DP on N/M chips')
  for m in learners:
    right.plot([n // m for n in chips],
               [100 * r.goodput for r in table[f'decoupled/{m}']], 'x',
               color=color[m], label=f'ours: Decoupled, M={m}')
    if paper_row[m] in PAPER:
      right.plot([n // m for n in PAPER_CHIPS], PAPER[paper_row[m]], 'o',
                 mfc='none', color=color[m])
  right.set(xscale='log', xlabel='chips per learner N / M',
            ylabel='goodput (%)',
            title='rule of thumb (circles: paper, M=1 is elastic DP)')
  right.legend(fontsize=7)
  fig.tight_layout()
  pathlib.Path(path).parent.mkdir(parents=True, exist_ok=True)
  fig.savefig(path, dpi=110)
  print(f'wrote {path}')


def _assumptions():
  return goodput.Assumptions(
      mtbi_s=_MTBI.value * goodput.YEAR_S, slice_size=_SLICE.value,
      recovery_s=_RECOVERY.value, restart_s=_RESTART.value,
      checkpoint_every_s=_CHECKPOINT.value, downscale_s=_DOWNSCALE.value,
      upscale_s=_UPSCALE.value, step_s=_STEP.value,
      sync_every=_SYNC_EVERY.value, sync_s=_SYNC.value,
      overlap=_OVERLAP.value)


def main(argv):
  del argv  # absl leaves only the program name
  command = ' '.join(['python -m experiments.goodput'] + sys.argv[1:])
  start = time.time()
  chips = [int(n) for n in _CHIPS.value]
  learners = [int(m) for m in _LEARNERS.value]
  horizon, seed = _HORIZON.value * goodput.DAY_S, _SEED.value
  a, info = _assumptions(), {}
  if _FIT.value:
    a, info = fit(a, chips, horizon, seed)
  table = simulate_table(a, chips, learners, horizon, seed)
  diffs = _differences(table, chips)
  thumb = rule_of_thumb(table, chips, learners, a, horizon, seed)
  measured = measure_table(a, chips, learners, seed) if _MEASURE.value \
      else None
  text = markdown(table, chips, a, _FIT.value, info, diffs, thumb, command,
                  measured)
  figure = _FIGURE.value or (_WORKDIR.value and
                             pathlib.Path(_WORKDIR.value) / 'goodput.png')
  if figure:
    plot(table, chips, learners, a, horizon, seed, figure)
  if not _WORKDIR.value:
    print(text)
    print(f'{time.time() - start:.0f} s (no --workdir: nothing written)')
    return
  workdir = pathlib.Path(_WORKDIR.value)
  results = {
      'command': command, 'chips': chips, 'learners': learners,
      'horizon_s': horizon, 'seed': seed, 'fitted': _FIT.value,
      'assumptions': dataclasses.asdict(a), 'fit': info,
      'paper_table_1_second_hand': {'chips': PAPER_CHIPS, **PAPER},
      'ours': {row: [r._asdict() for r in rs] for row, rs in table.items()},
      'ours_minus_paper_points': diffs, 'rule_of_thumb': thumb,
      'measured': None if measured is None else {
          'timeline': {'num_steps': _TIMELINE_STEPS.value,
                       'sync_every': _TIMELINE_H.value,
                       'num_fragments': _TIMELINE_P.value,
                       'quorum': _TIMELINE_K.value,
                       'grace': _TIMELINE_GRACE.value},
          **{f'decoupled/{m}': [dataclasses.asdict(g) for g in cells]
             for m, cells in measured.items()}},
      'seconds': time.time() - start}
  _runs.write(workdir, 'goodput', text, results)
  print(f'{time.time() - start:.0f} s')


if __name__ == '__main__':
  app.run(main)
