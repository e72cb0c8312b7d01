r"""The tables in ``docs/``, rendered from the committed results files.

A table generated from results sits in a docs page between markers::

  <!-- results:<name>:<table> -->
  ...rendered by RENDERERS[(name, table)] from docs/results/<name>.json...
  <!-- /results -->

and nothing between the markers is typed by hand: this module rewrites it.

  python -m experiments.tables            # rewrite docs/*.md in place
  python -m experiments.tables --check    # exit 1 naming stale tables

Both also say which results files were made on another corpus than this
machine's (:func:`corpus_report`: the default text is the running
Python's standard library, so another Python reads other text), or on a
corpus nobody recorded; ``--check --strict_corpus`` exits 1 for those too.

``tests/test_results_tables.py`` runs the check, and also that every table
in ``docs/`` with numbers in it is either between markers or listed there
as hand-written with a reason. The benchmark programs print their tables
with the same renderers, so their ``.md`` output is the docs table.
"""

import argparse
import json
import pathlib
import re
import sys
import textwrap
from typing import Any, Callable

# The renderer modules register their tables and figures in _registry when
# imported; this module reads them there.
from experiments import _async_tables  # pylint: disable=unused-import
from experiments import _ckpt_tables  # pylint: disable=unused-import
from experiments import _claims  # pylint: disable=unused-import
from experiments import _compress_tables  # pylint: disable=unused-import
from experiments import _fault_tables  # pylint: disable=unused-import
from experiments import _frontier_tables  # pylint: disable=unused-import
from experiments import _outer_sweep  # pylint: disable=unused-import
from experiments import _registry
from experiments import _sharding_tables  # pylint: disable=unused-import
from experiments import _small_tables  # pylint: disable=unused-import
from experiments import _train_tables  # pylint: disable=unused-import

REPO = pathlib.Path(__file__).resolve().parent.parent
DOCS = REPO / 'docs'
RESULTS = DOCS / 'results'

# Markers stand alone on their lines.
MARKER = re.compile(
    r'^(?P<open><!-- results:(?P<name>[\w-]+):(?P<table>[\w-]+) -->\n)'
    r'(?P<body>.*?)^(?P<close><!-- /results -->)$', re.S | re.M)


format_bytes = _registry.format_bytes
format_time = _registry.format_time


def _machine(p: dict[str, Any]) -> str:
  pk, dev = p['packages'], p['device']
  return (f'jax {pk["jax"]}, flax {pk["flax"]}, optax {pk["optax"]}; '
          f'{dev["device_count"]} x {dev["device_kind"]} devices, '
          f'{dev["host_cpus"]} host CPUs')


def _machines(data: dict[str, Any]) -> str:
  """Packages and devices of the runs (with run counts where the runs were
  trained on more than one setup, e.g. some on a GPU), else of the writer."""
  counts: dict[str, int] = {}
  for run in data.get('runs', []):
    if 'packages' in run['provenance'] and 'device' in run['provenance']:
      key = _machine(run['provenance'])
      counts[key] = counts.get(key, 0) + 1
  if len(counts) <= 1:
    return next(iter(counts), _machine(data['provenance']))
  return '; '.join(f'{k} ({n} runs)' for k, n in sorted(counts.items()))


def source_line(name: str, data: dict[str, Any]) -> str:
  """A paragraph under a table: the results file, the commit of the code
  that trained its runs (or, without runs, that computed it; dirty trees
  flagged), packages, devices and how to regenerate it."""
  def commit(p):
    return f'`{(p["commit"] or "no git")[:10]}`' + (' (dirty)' if p['dirty']
                                                   else '')
  counts: dict[str, int] = {}
  unknown = 0
  for run in data.get('runs', []):
    if 'commit' not in run['provenance']:
      unknown += 1
    else:
      key = commit(run['provenance'])
      counts[key] = counts.get(key, 0) + 1
  p = data['provenance']
  if counts or unknown:
    parts = [f'{c} ({n} runs)' if len(counts) + bool(unknown) > 1 else c
             for c, n in sorted(counts.items())]
    parts += [f'{unknown} runs without a record'] if unknown else []
    made = f'runs trained at commit {", ".join(parts)}'
  else:
    made = f'computed at commit {commit(p)}'
  benchmark = data.get('benchmark', name)
  again = _REGENERATE.get(benchmark, '`python -m experiments.regenerate '
                          f'--workdir=DIR --only={benchmark}`')
  text = (f'Source: [`docs/results/{name}.json`](results/{name}.json), '
          f'written {p["time_utc"][:10]}; {made}; {_machines(data)}'
          f'{_corpus_phrase(data)}. Regenerate: {again}.')
  return textwrap.fill(text, 79, break_on_hyphens=False,
                       break_long_words=False)


def _corpus_phrase(data: dict[str, Any]) -> str:
  """``'; text: the Python 3.12.1 standard library (sha256 `...`)'``: the
  corpus the table was made on (what its numbers need to reproduce), or
  that it is not recorded; empty for results that read no text."""
  record = data.get('corpus')
  if record is not None and record.get('reads_text') is False:
    return ''
  if record is None or record.get('reads_text') is None:
    return '; text: not recorded'
  parts = []
  for fp in record['fingerprints']:
    source = {'stdlib': f'the Python {fp.get("python")} standard library',
              'corpus_file': 'a corpus file' + (
                  f' of the Python {fp["python"]} standard library'
                  if fp.get('python') else ''),
              'source_dirs': 'local files',
              'tfds': f'TFDS {fp["data"].get("dataset")}'}[fp['source']]
    parts.append(f'{source} (sha256 `{fp["sha256"][:12]}`)')
  n = len(record.get('unknown_runs', []))
  if n:
    parts.append(f'{n} run{"s" * (n > 1)} on unrecorded text')
  return '; text: ' + ', '.join(parts)


# Results that experiments.regenerate does not make (they need JAX's CUDA
# plugin or a GPU): how to make them again.
_REGENERATE = {
    'async_chaos': '`nice -n 19 python -m experiments.async_chaos '
                   '--out=DIR --seconds=150` (copy DIR/async_chaos.json)',
    'overlap_gpu': '`make overlap-gpu WORKDIR=DIR` (no GPU needed)',
    'overlap_gpu_h100': '`bash experiments/reference/overlap_h100.sh` on a '
                        'machine with one GPU',
}


def compare_dp_diloco_main(data: dict[str, Any]) -> str:
  """The data-parallel vs DiLoCo table."""
  res = data['results']
  s = res['setup']
  tokens = s['num_steps'] * s['batch_size'] * s['seq_len']
  lines = [
      f'{s["num_steps"]} steps x {s["batch_size"]} x {s["seq_len"]} = '
      f'{tokens:,} tokens; {s["workers"]} workers x '
      f'{s["devices_per_worker"]} devices; outer Nesterov lr '
      f'{s["outer_learning_rate"]:g}, momentum {s["outer_momentum"]:g}.', '',
      '| method | H | final eval loss | cross-worker bytes | syncs |',
      '|---|---|---|---|---|']
  best = min(r['final_eval_loss'] for r in res['rows'])
  for r in res['rows']:
    loss = f'{r["final_eval_loss"]:.4f}'
    if r['final_eval_loss'] == best:
      loss = f'**{loss}**'
    syncs = (f'{r["steps"]} all-reduces' if r['method'] == 'data_parallel'
             else str(r['syncs']))
    lines.append(f'| {r["label"]} | {r["sync_every"]} | {loss} | '
                 f'{r["cross_worker_bytes"]:,} '
                 f'({format_bytes(r["cross_worker_bytes"])}) | {syncs} |')
  if res.get('pending'):
    lines += ['', f'Not run yet: {", ".join(res["pending"])}.']
  return '\n'.join(lines) + '\n'


def diloco_family_main(data: dict[str, Any]) -> str:
  """The DiLoCo family table: loss, bytes and simulated time per run."""
  res = data['results']
  s = res['setup']
  tokens = s['num_steps'] * s['batch_size'] * s['seq_len']
  lines = [
      f'{tokens:,} tokens per run ({s["num_steps"]} steps x '
      f'{s["batch_size"]} x {s["seq_len"]}); {s["workers"]} workers x '
      f'{s["devices_per_worker"]} devices; H = {s["sync_every"]}; model '
      f'{s["num_params"]:,} params. Simulated time: this model at '
      f'{s["step_time_s"]} s/step, and projected to '
      f'{s["projected_params"]:.3g} params at {s["projected_step_time_s"]} '
      f's/step; latency {s["latency_s"]} s.', '',
      '| run | final eval loss | total cross-worker bytes | peak bytes '
      '/ step | time @1 Gbit/s (util) | time @100 Gbit/s (util) | projected '
      '@1 Gbit/s (util) | projected @100 Gbit/s (util) |',
      '|---|---|---|---|---|---|---|---|']
  for r in res['rows']:
    cells = [r['label'], f'{r["final_eval_loss"]:.4f}',
             f'{r["cross_worker_bytes"]:,}', f'{r["peak_bytes_per_step"]:,}']
    for prefix in ('', 'projected_'):
      for tag in ('1gbps', '100gbps'):
        cells.append(f'{format_time(r[prefix + tag + "_s"])} '
                     f'({r[prefix + tag + "_util"]:.0%})')
    lines.append('| ' + ' | '.join(cells) + ' |')
  if res.get('pending'):
    lines += ['', f'Not run yet: {", ".join(res["pending"])}.']
  return '\n'.join(lines) + '\n'


def wire_bytes_main(data: dict[str, Any]) -> str:
  """Bytes on the wire of every codec against its theoretical payload."""
  res = data['results']
  s = res['setup']
  fp32 = 4 * s['num_params']
  lines = [f'{s["num_params"]:,} parameters ({s["rows"]}x{s["cols"]} matrix '
           f'+ bias); fp32 = {fp32:,} B per worker', '',
           '| scheme | measured B/worker | theory B | measured/theory | '
           'fp32/measured |', '|---|---|---|---|---|']
  for r in res['rows']:
    sent, theory = r['measured_bytes_per_worker'], r['theory_bytes']
    lines.append(f'| {r["label"]} | {sent:,.0f} | {theory:,} | '
                 f'{sent / theory:.3f} | {fp32 / sent:.1f} |')
  return '\n'.join(lines) + '\n'


def _chips(n: int) -> str:
  """``150000 -> '150k'``, ``1200000 -> '1.2M'``."""
  return f'{n / 1e6:g}M' if n >= 1_000_000 else f'{n / 1e3:g}k'


def goodput_main(data: dict[str, Any]) -> str:
  """Goodput per policy and chip count, ours / the paper's Table 1."""
  res = data['results']
  chips, paper = res['chips'], res['paper_table_1_second_hand']
  fitted = ' (fitted)' if res['fitted'] else ''
  rows = [('dp', f'DP, no elasticity{fitted}'),
          ('elastic_dp', f'elastic DP{fitted}')]
  measured = res.get('measured') or {}
  bound = ' (renewal model, upper bound)' if measured else ''
  rows += [(f'decoupled/{m}', f'Decoupled DiLoCo, M={m}{bound}')
           for m in res['learners'] if m > 1]
  rows += [(f'measured:decoupled/{m}',
            f'Decoupled DiLoCo, M={m}, measured on its timeline')
           for m in res['learners'] if f'decoupled/{m}' in measured]
  rows += [(f'diloco/{m}', f'synchronous DiLoCo, M={m}')
           for m in res['learners'] if f'diloco/{m}' in res['ours']]
  lines = ['| policy | ' + ' | '.join(_chips(n) for n in chips) + ' |',
           '|---|' + '---:|' * len(chips)]
  for key, label in rows:
    source, _, row = key.rpartition(':')
    theirs = dict(zip(paper['chips'], paper.get(row, [])))
    if source:  # measured: no paper figure to put beside it
      theirs = {}
    cells = [f'{100 * r["goodput"]:.0f} / '
             + (f'{theirs[n]:.0f}' if n in theirs else '–')
             for n, r in zip(chips, (measured if source else
                                     res['ours'])[row])]
    lines.append(f'| {label} | ' + ' | '.join(cells) + ' |')
  return '\n'.join(lines) + '\n'


def diloco_family_figure(data: dict[str, Any], path: pathlib.Path,
                         ylim: tuple[float, float] = (1.6, 2.6)) -> None:
  """Final loss against total bytes and against projected simulated time;
  runs above the y-range are named in the title."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  rows = data['results']['rows']
  fig, axes = plt.subplots(1, 2, figsize=(13, 5))
  above = [f'{r["name"]} {r["final_eval_loss"]:.2f}' for r in rows
           if r['final_eval_loss'] > ylim[1]]
  for ax, key, title in (
      (axes[0], 'cross_worker_bytes', 'total cross-worker bytes'),
      (axes[1], 'projected_1gbps_s', 'simulated seconds at 1 Gbit/s '
       '(bytes projected to the larger model)')):
    for r in rows:
      if r['final_eval_loss'] > ylim[1]:
        continue
      ax.scatter(r[key], r['final_eval_loss'])
      name = r['name'] + (' (slow worker)' if 'straggler' in r['label']
                          and r['name'] == 'diloco' else '')
      ax.annotate(name, (r[key], r['final_eval_loss']),
                  textcoords='offset points', xytext=(4, 3), fontsize=8)
    ax.set_xscale('log')
    ax.set_ylim(*ylim)
    ax.set_xlabel(title)
    ax.set_ylabel('final eval loss')
    ax.grid(True, alpha=0.3)
  if above:
    fig.suptitle('above the plotted range: ' + ', '.join(above), fontsize=9)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def outer_sweep_main(data: dict[str, Any]) -> str:
  """Final eval loss per method, M and outer lr (rows) and outer momentum
  (columns); the best of each method and M in bold."""
  res = data['results']
  s = res['setup']
  rows = [r for r in res['rows'] if r.get('seed', 0) == 0]
  momenta = sorted({r['momentum'] for r in rows}, reverse=True)
  best: dict[tuple[str, int], float] = {}
  for r in rows:
    key = (r['method'], r['workers'])
    best[key] = min(best.get(key, float('inf')), r['final_eval_loss'])
  model = (f'{s["size"]} LM ({s["num_params"]:,} parameters), inner lr '
           f'{s["inner_learning_rate"]:g}; ' if s.get('size') else '')
  where = ('M workers stacked on one device' if s.get('simulate_workers')
           else f'M workers x {s["devices"]} / M devices')
  seeds = ' (seed 0)' if len(rows) < len(res['rows']) else ''
  lines = [f'{model}{s["num_steps"]} steps x {s["batch_size"]} x '
           f'{s["seq_len"]} tokens; H = {s["sync_every"]}; {where}; outer '
           f'{"Nesterov" if s["nesterov"] else "heavy-ball"} SGD. Final eval '
           f'loss{seeds}:', '',
           '| method | M | outer lr | ' + ' | '.join(
               f'momentum {m:g}' for m in momenta) + ' |',
           '|---|---|---|' + '---|' * len(momenta)]
  keys = []
  for r in rows:
    key = (r['method'], r['workers'], r['learning_rate'])
    if key not in keys:
      keys.append(key)
  methods = list(dict.fromkeys(k[0] for k in keys))
  keys.sort(key=lambda k: methods.index(k[0]))  # stable: by method
  for method, m, lr in keys:
    cells = []
    for mom in momenta:
      hit = [r for r in rows if (r['method'], r['workers'],
                                 r['learning_rate'], r['momentum'])
             == (method, m, lr, mom)]
      if not hit:
        cells.append('')
        continue
      loss = hit[0]['final_eval_loss']
      text = f'{loss:.4f}'
      cells.append(f'**{text}**' if loss == best[(method, m)] else text)
    lines.append(f'| {method} | {m} | {lr:g} | ' + ' | '.join(cells) + ' |')
  if res.get('pending'):
    lines += ['', f'Not run yet: {", ".join(res["pending"])}.']
  return '\n'.join(lines) + '\n'


# The tables and figures rendered by this module; the others register
# theirs in their own modules (imported above).
_registry.tables({
    ('outer_sweep', 'main'): outer_sweep_main,
    ('outer_sweep_own', 'main'): outer_sweep_main,
    ('outer_sweep_budget', 'main'): outer_sweep_main,
    ('compare_dp_diloco', 'main'): compare_dp_diloco_main,
    ('diloco_family', 'main'): diloco_family_main,
    ('wire_bytes', 'main'): wire_bytes_main,
    ('goodput', 'main'): goodput_main,
})
_registry.figure('diloco_family', diloco_family_figure,
                 'figures/diloco_family.png')
RENDERERS = _registry.RENDERERS
FIGURES = _registry.FIGURES
# Figures drawn from what has finished while runs are still pending (the
# table under them lists what is left).
DRAW_WHILE_PENDING = frozenset({'claims', 'claims_long', 'claims_budget',
                                'frontier', 'frontier_459k'})


def _local_corpus(data: dict[str, Any], cache: dict[str, Any]) -> Any:
  """This machine's fingerprint for the data fields ``data``, or the error
  that kept it from being computed (as a string)."""
  from loc_opt import data as data_lib  # pylint: disable=g-import-not-at-top
  key = json.dumps(data, sort_keys=True)
  if key not in cache:
    try:
      cache[key] = data_lib.corpus_fingerprint(data)
    except (OSError, ValueError) as e:
      cache[key] = f'{type(e).__name__}: {e}'
  return cache[key]


def corpus_report(results_dir: pathlib.Path = RESULTS,
                  names: list[str] | None = None) -> list[str]:
  """A line for each results file whose corpus is not this machine's.

  Each fingerprint in a file's ``corpus`` record (``experiments._runs.
  corpus_record``) is recomputed here from its data fields (the text is
  read, nothing is trained) and compared. A file without a record, or with
  runs whose corpus was never recorded, gets a line saying so.

  Args:
    results_dir: the folder of results files (subfolders included).
    names: only these results files (``<name>.json`` in ``results_dir``).

  Returns:
    ``'<file>: ...'`` lines; none if every corpus matches.
  """
  from loc_opt.data import corpus  # pylint: disable=g-import-not-at-top
  paths = ([results_dir / f'{n}.json' for n in names] if names is not None
           else sorted(results_dir.rglob('*.json')))
  cache: dict[str, Any] = {}
  out = []
  for path in paths:
    if not path.exists():
      continue
    rel = path.relative_to(results_dir)
    data = json.loads(path.read_text())
    record = data.get('corpus') if isinstance(data, dict) else None
    if record is None:
      out.append(f'{rel}: no corpus record (written before fingerprints '
                 'were kept): the text it was made on is unknown')
      continue
    if record.get('reads_text') is None:
      out.append(f'{rel}: corpus unknown ({record.get("note", "")})')
    if record.get('unknown_runs'):
      n = len(record['unknown_runs'])
      out.append(f'{rel}: {n} run{"s" * (n > 1)} on an unrecorded corpus'
                 + (f' ({record["note"]})' if record.get('note') else ''))
    for fp in record.get('fingerprints', []):
      local = _local_corpus(fp['data'], cache)
      if isinstance(local, str):
        out.append(f'{rel}: made on {corpus.describe(fp)}, which is not on '
                   f'this machine ({local})')
      elif local['sha256'] != fp['sha256']:
        out.append(f'{rel}: made on {corpus.describe(fp)}; this machine '
                   f'reads {corpus.describe(local)} with the same data '
                   'fields, so its numbers may not reproduce here (train '
                   'on a corpus file of that text: docs/benchmarks.md, '
                   '"The corpus")')
  return out


def load(name: str, results_dir: pathlib.Path = RESULTS) -> dict[str, Any]:
  """The results file ``results_dir/<name>.json``."""
  path = results_dir / f'{name}.json'
  if not path.exists():
    raise FileNotFoundError(f'no results file {path} for the tables of '
                            f'{name!r}; run its benchmark (python -m '
                            f'experiments.regenerate --only={name})')
  data = json.loads(path.read_text())
  if 'provenance' not in data or 'results' not in data:
    raise ValueError(f'{path} is not a results file of experiments._runs.'
                     'write (no provenance or results): rerun its benchmark')
  return data


def render(name: str, table: str, data: dict[str, Any]) -> str:
  """The markdown of table ``table`` of results ``name``, without the
  source line."""
  if (name, table) not in RENDERERS:
    raise KeyError(f'no renderer for table {table!r} of results {name!r}; '
                   f'known: {sorted(RENDERERS)}')
  return RENDERERS[(name, table)](data)


def block(name: str, table: str, results_dir: pathlib.Path = RESULTS) -> str:
  """What belongs between the markers of ``name:table``: the table and its
  source line."""
  data = load(name, results_dir)
  return render(name, table, data) + '\n' + source_line(name, data) + '\n'


def rerender(text: str, results_dir: pathlib.Path = RESULTS) -> str:
  """``text`` with every marked block rendered afresh."""
  def sub(m):
    body = block(m['name'], m['table'], results_dir)
    return m['open'] + body + m['close']
  return MARKER.sub(sub, text)


def marked(text: str) -> list[tuple[str, str, int, int]]:
  """``(name, table, start, end)`` of every marked block's body in
  ``text``; an opening marker without its close is an error."""
  out = [(m['name'], m['table'], m.start('body'), m.end('body'))
         for m in MARKER.finditer(text)]
  opens = len(re.findall(r'^<!-- results:', text, re.M))
  if opens != len(out):
    raise ValueError(f'{opens} opening results markers but {len(out)} '
                     'closed blocks: a "<!-- /results -->" is missing or '
                     'a marker is malformed (<!-- results:name:table -->)')
  return out


def markdown_tables(text: str) -> list[tuple[str, int, int, bool]]:
  """``(header row, first line, end line, has numbers)`` of every Markdown
  table in ``text`` outside fenced code, lines counted from 0; a table has
  numbers if a cell of a body row holds a digit."""
  lines = text.split('\n')
  out, fence, i = [], False, 0
  while i < len(lines):
    line = lines[i].strip()
    if line.startswith('```'):
      fence = not fence
    elif (not fence and line.startswith('|') and i + 1 < len(lines)
          and re.fullmatch(r'\|(\s*:?-+:?\s*\|)+', lines[i + 1].strip())):
      end = i + 2
      while end < len(lines) and lines[end].strip().startswith('|'):
        end += 1
      numbers = any(re.search(r'\d', row) for row in lines[i + 2:end])
      out.append((line, i, end, numbers))
      i = end
      continue
    i += 1
  return out


def unsourced_tables(text: str) -> list[tuple[str, int]]:
  """``(header row, line)`` of the tables with numbers in ``text`` that are
  not between results markers."""
  starts = [text.count('\n', 0, start) for _, _, start, _ in marked(text)]
  ends = [text.count('\n', 0, end) for _, _, _, end in marked(text)]
  return [(header, first) for header, first, end, numbers
          in markdown_tables(text)
          if numbers and not any(s <= first and end <= e + 1
                                 for s, e in zip(starts, ends))]


def docs_pages(docs: pathlib.Path = DOCS) -> list[pathlib.Path]:
  """The Markdown pages of ``docs`` and its subfolders (not the Sphinx
  build's)."""
  return sorted(p for p in docs.rglob('*.md')
                if '_build' not in p.relative_to(docs).parts)


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--check', action='store_true',
                      help='Only report stale tables; exit 1 if any.')
  parser.add_argument('--figures', action='store_true',
                      help='Also redraw the figures of FIGURES.')
  parser.add_argument('--strict_corpus', action='store_true',
                      help='With --check, exit 1 also when a results file '
                      'was made on another corpus than this machine\'s, or '
                      'on an unrecorded one.')
  args = parser.parse_args(argv)
  stale = []
  for page in docs_pages():
    text = page.read_text()
    if not marked(text):
      continue
    new = rerender(text)
    if new != text:
      stale.append(page.relative_to(REPO))
      if not args.check:
        page.write_text(new)
  if args.figures and not args.check:
    for name, (draw, rel) in FIGURES.items():
      if not (RESULTS / f'{name}.json').exists():
        continue
      data = load(name)
      res = data['results']  # A dict, or a list of rows (compression).
      pending = isinstance(res, dict) and res.get('pending')
      if pending and name not in DRAW_WHILE_PENDING:  # Kept until all in.
        print(f'{rel}: not redrawn, runs pending')
        continue
      draw(data, DOCS / rel)
      print(f'drew {DOCS / rel}')
  verb = 'stale' if args.check else 'rewrote'
  print(f'{verb}: {", ".join(map(str, stale)) or "none"}')
  corpus_lines = corpus_report()
  for line in corpus_lines:
    print(f'corpus: {line}')
  if not corpus_lines:
    print('corpus: every results file was made on this machine\'s corpus')
  failed = stale or (args.strict_corpus and corpus_lines)
  return 1 if args.check and failed else 0


if __name__ == '__main__':
  sys.exit(main())
