"""The method tables of the API reference, one row per registry entry.

Each table lists the entries of one registry that configs name things in
(``outer.method``, ``optimizer.name``, ``optimizer.schedule``,
``outer.codec``, ...). The rows here give what the code cannot: the paper,
the bytes a worker sends per sync and when to use the method. The set of
rows is checked against the registry itself, so a method registered without
a row, or a row left after its method was removed, stops the docs build
(``registry_tables``) and the test ``tests/test_docs_tables.py``. Where the
code can say a number (a codec's ``payload_bytes``, the size of an inner
optimizer's state), the table computes it rather than restating it.

Notation in the cells (reStructuredText inline markup): ``N`` parameters
(fp32, 4 bytes each), ``H`` inner steps between syncs, ``M`` workers,
``P`` fragments, ``G`` workers per group.

This module needs no Sphinx: the test imports it.
"""

from collections.abc import Callable, Mapping
import importlib
from typing import Any, NamedTuple


class Row(NamedTuple):
  """What the docs say of one registry entry.

  Attributes:
    api: dotted path of the library function ('' where there is none).
    paper: the reference (authors, *title*, year), or what it is if it is a
      baseline.
    bytes: bytes one worker sends per sync, in ``N`` parameters.
    use: when to use it.
    kwargs: arguments the computed column builds the entry with (the
      defaults where empty); shown in the config-key cell.
    measure: dotted path of the library's byte count for the method,
      ``fn(params) -> bytes`` one worker sends per sync ('' where it has
      none that takes only the parameters).
  """

  api: str
  paper: str
  bytes: str
  use: str
  kwargs: Mapping[str, Any] = {}
  measure: str = ''


class Table(NamedTuple):
  """One registry and its rows.

  Attributes:
    registry: ``'module:NAME'`` of the registry (a mapping or a tuple of
      names).
    key: the config field that takes the names.
    rows: one row per registry name, in the order of the table.
    computed: ``(header, fn)``: a column whose cell is ``fn(name, row)``
      computed from the code, or None.
    first: the header of the first column.
    kwargs_key: the config field of a row's ``kwargs``.
  """

  registry: str
  key: str
  rows: Mapping[str, Row]
  computed: tuple[str, Callable[[str, Row], str]] | None = None
  first: str = 'Method'
  kwargs_key: str = ''


_DILOCO = ('Douillard et al., *DiLoCo: Distributed Low-Communication '
           'Training of Language Models*, 2023')
_OPTAX = 'baseline (Optax)'
_LOCAL = '0: runs on each worker'

# --------------------------------------------------------------- computed


# The reference tree of the computed columns: a 1024 x 1024 matrix.
_SHAPE = (1024, 1024)
_N = _SHAPE[0] * _SHAPE[1]


def _fmt(x: float) -> str:
  return f'{x:.3g}'


def _codec_bytes(name: str, row: Row) -> str:
  """B/param one worker sends for the reference tree (``payload_bytes``)."""
  import jax  # pylint: disable=import-outside-toplevel
  from loc_opt import compression  # pylint: disable=import-outside-toplevel
  tree = {'w': jax.ShapeDtypeStruct(_SHAPE, 'float32')}
  return _fmt(compression.make_compressor(name, **row.kwargs).payload_bytes(
      tree) / _N)


def _method_bytes(name: str, row: Row) -> str:
  """B/param one worker sends per sync for the reference tree, from the
  method's own byte count (``row.measure``)."""
  del name
  if not row.measure:
    return '--'
  import jax  # pylint: disable=import-outside-toplevel
  tree = {'w': jax.ShapeDtypeStruct(_SHAPE, 'float32')}
  return _fmt(load(row.measure)(tree) / _N)


def _state_bytes(name: str, row: Row) -> str:
  """B/param of the inner optimizer's state for the reference tree."""
  import jax  # pylint: disable=import-outside-toplevel
  from loc_opt import inner  # pylint: disable=import-outside-toplevel
  tree = {'w': jax.ShapeDtypeStruct(_SHAPE, 'float32')}
  state = jax.eval_shape(inner.OPTIMIZERS[name](1e-3, **row.kwargs).init,
                         tree)
  size = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state))
  return _fmt(size / _N)


# ------------------------------------------------------------------ outer

OUTER = Table(
    registry='loc_opt.train.registry:METHODS',
    key='outer.method',
    computed=('B/param (computed)', _method_bytes),
    rows={
        'data_parallel': Row(
            '', 'baseline: synchronous data parallelism',
            'the fp32 gradient all-reduced every step (GSPMD picks the '
            'collectives), not once per ``H`` steps',
            'the reference every method is measured against; all devices '
            'on fast links (the trainer runs the inner optimizer alone)'),
        'diloco': Row(
            'loc_opt.outer.diloco', _DILOCO,
            '``4N`` every ``H`` steps (the fp32 pseudo-gradient, one '
            'all-reduce), or the payload of ``outer.codec``',
            'the default: workers joined by slow links; ``H`` in the tens '
            'to hundreds, outer Nesterov (0.7, 0.9)',
            measure='loc_opt.outer.pseudo_gradient_bytes'),
        'local_sgd': Row(
            'loc_opt.outer.local_sgd',
            'McMahan et al., *Communication-Efficient Learning of Deep '
            'Networks from Decentralized Data*, 2017; Stich, *Local SGD '
            'Converges Fast and Communicates Little*, 2019',
            '``4N`` every ``H`` steps (parameters averaged)',
            'the parameter-averaging baseline: DiLoCo with outer SGD at '
            'rate 1, no momentum',
            measure='loc_opt.outer.pseudo_gradient_bytes'),
        'compressed_data_parallel': Row(
            'loc_opt.compression.compressed_all_reduce',
            'the codec\'s (see :doc:`compression`)',
            'the payload of ``outer.codec`` every step, e.g. ``1.02N`` '
            'with ``int8``',
            'data parallelism over a link too slow for fp32 gradients but '
            'fast enough for a compressed gradient every step'),
        'streaming_diloco': Row(
            'loc_opt.outer.streaming_diloco',
            'Douillard et al., *Streaming DiLoCo with overlapping '
            'communication: Towards a Distributed Free Lunch*, 2025',
            '``4N/P`` per fragment sync, one of ``P`` fragments every '
            '``H/P`` steps (``4N`` per ``H`` steps in all; the peak is the '
            'largest fragment); about an eighth of that with ``fp4_e3m0``',
            'peak bandwidth is the limit: spreads the sync over the round '
            'and overlaps each transfer with ``tau`` inner steps'),
        'decoupled_diloco': Row(
            'loc_opt.outer.decoupled_diloco',
            'Douillard et al., *Decoupled DiLoCo for Resilient Distributed '
            'Pre-training*, 2026',
            'each merge sends one fragment once: ``4N/P`` per learner',
            'stragglers and failures: learners on their own clocks, merges '
            'with a quorum and a grace window, nobody waits (see '
            ':doc:`../decoupled_diloco`)'),
        'eager_diloco': Row(
            'loc_opt.outer.eager_diloco',
            'Kale, Douillard, Donchev, *Eager Updates For Overlapped '
            'Communication and Computation in DiLoCo*, 2025',
            '``4N`` every ``H`` steps, overlapped with the next round',
            'hide a slow sync behind a round of compute: the local '
            'pseudo-gradient stands in for the average still in flight',
            measure='loc_opt.outer.eager_bytes'),
        'noloco': Row(
            'loc_opt.outer.noloco',
            'Kolehmainen et al., *NoLoCo: No-all-reduce Low Communication '
            'Training Method for Large Models*, 2025',
            '``8N`` (anchor and pseudo-gradient) to each of ``G - 1`` '
            'peers every ``H`` steps; no all-reduce',
            'no global collective: workers average with random peers; '
            'many workers on slow links',
            measure='loc_opt.outer.noloco_bytes'),
        'demo': Row(
            'loc_opt.outer.demo',
            'Peng, Quesnelle, Kingma, *DeMo: Decoupled Momentum '
            'Optimization*, 2024',
            'every step: ``topk`` DCT coefficients per ``chunk x chunk`` '
            'tile, fp32 value and 12-bit index each: ``0.043N`` at the '
            'defaults (32 of 64 x 64), all-gathered',
            'synchronize every step at a tiny payload; DeMo replaces the '
            'optimizer (a sign step on the shared fast components)',
            measure='loc_opt.outer.demo_payload_bytes'),
        'sparseloco': Row(
            'loc_opt.outer.sparseloco',
            'Sarfi, Thérien, Lidin, Belilovsky, *Communication Efficient '
            'LLM Pre-training with SparseLoCo*, 2025',
            'every ``H`` steps: top-128 of each 64 x 64 tile of the '
            'error-feedback buffer, 2-bit values and 12-bit indices: '
            '``0.055N`` + 20 B per tensor, all-gathered',
            'the smallest payload of the family (about 70x below fp32 '
            'DiLoCo)',
            measure='loc_opt.outer.sparseloco_payload_bytes'),
        'desloc': Row(
            'loc_opt.outer.desloc',
            'Iacob et al., *DES-LOC: Desynced Low Communication Adaptive '
            'Optimizers for Training Foundation Models*, 2025',
            '``4N`` parameters every ``K_x`` steps, ``4N`` first moment '
            'every ``K_u`` and ``4N`` second moment every ``K_v``',
            'Adam-family inner optimizers: keeps the moments in step on '
            'their own, slower periods'),
        'mt_dao': Row(
            'loc_opt.outer.mt_dao',
            'Iacob et al., *MT-DAO: Multi-Timescale Distributed Adaptive '
            'Optimizers with Local Updates*, 2025',
            '``12N`` every ``H`` steps: parameters, slow momentum and '
            'second moment',
            'with ``optimizer.name=\'multi_timescale_adam\'``: slow momenta '
            'keep the workers aligned over long ``H``'),
        'edit_diloco': Row(
            'loc_opt.outer.edit_diloco',
            'Cheng et al., *EDiT: A Local-SGD-Based Efficient Distributed '
            'Training Method for Large Language Models*, ICLR 2025',
            '``4N`` + 8 B every ``H`` steps (the pseudo-gradient and its '
            'norm statistics)',
            'loss spikes or a bad worker: pseudo-gradients with anomalous '
            'norms are down-weighted, clipped or dropped',
            measure='loc_opt.outer.edit_bytes'),
        'co2': Row(
            'loc_opt.outer.co2',
            'Sun et al., *CO2: Efficient Distributed Training with Full '
            'Communication-Computation Overlap*, ICLR 2024',
            '``4N`` every ``H`` steps, applied one round stale',
            'overlap the whole all-reduce with the next round; a staleness '
            'penalty and a clip keep the stale step stable',
            measure='loc_opt.outer.co2_bytes'),
        'hierarchical_diloco': Row(
            'loc_opt.outer.hierarchical_diloco',
            'Kim et al., *HALoS: Hierarchical Asynchronous Local SGD over '
            'Slow Networks for Geo-Distributed Large Language Model '
            'Training*, ICML 2025; Thérien et al., *MuLoCo*, 2025 '
            '(TreeLoCo)',
            '``(G - 1) 4N`` inside the group every ``H1`` steps; between '
            'groups ``4N`` only every ``H2`` steps',
            'two link speeds (racks or regions): sync often inside a group, '
            'rarely between groups (see :doc:`../hierarchical`)'),
        'group_diloco': Row(
            'loc_opt.outer.group_diloco',
            'Douillard et al., *DiLoCo*, 2023; a router sync period of its '
            'own as in MaxText\'s MoE DiLoCo recipe',
            '``4N_g`` every ``H_g`` steps (the group, e.g. the routers), '
            '``4(N - N_g)`` every ``H``',
            'a Mixture-of-Experts LM whose routers should sync more (or '
            'less) often than the experts (see :doc:`../moe`)'),
        'async_local_sgd': Row(
            'loc_opt.outer.async_local_sgd',
            'Liu et al., *Asynchronous Local-SGD Training for Language '
            'Modeling*, 2024',
            '``4N`` per worker round (its push; a parameter server sends '
            '``4N`` back)',
            'workers of different speeds: nobody waits; Delayed Nesterov '
            'and DyLU keep the stale pushes stable',
            measure='loc_opt.outer.push_bytes'),
    },
)

AGGREGATES = Table(
    registry='loc_opt.outer.robust:AGGREGATES',
    key='outer.aggregate',
    first='Rule',
    rows={
        'mean': Row(
            'loc_opt.outer.diloco', _DILOCO,
            'the method\'s: ``4N`` for fp32 DiLoCo (all-reduce)',
            'trusted workers'),
        'median': Row(
            'loc_opt.outer.diloco',
            'Yin, Chen, Ramchandran, Bartlett, *Byzantine-Robust '
            'Distributed Learning: Towards Optimal Statistical Rates*, ICML '
            '2018',
            'sends ``4N`` (or a stateless codec\'s payload) once but '
            'receives ``(M - 1) 4N``: an all-gather',
            'some workers may send wrong pseudo-gradients (bad nodes, open '
            'training); see :doc:`../robust_aggregation`'),
        'trimmed_mean': Row(
            'loc_opt.outer.diloco',
            'Yin, Chen, Ramchandran, Bartlett, *Byzantine-Robust '
            'Distributed Learning: Towards Optimal Statistical Rates*, ICML '
            '2018',
            'as the median: an all-gather of ``4N`` (or a codec\'s payload)',
            'as the median, closer to the mean when few workers are bad'),
        'norm_clipped_mean': Row(
            'loc_opt.outer.diloco',
            'Karimireddy, He, Jaggi, *Learning from History for Byzantine '
            'Robust Optimization*, ICML 2021',
            '``4N`` all-reduce plus two scalars per worker (the norms)',
            'bound one worker\'s pull at the all-reduce\'s cost'),
    },
)

# ------------------------------------------------------------------ inner

_STATE = ('State (B/param, computed)', _state_bytes)

INNER = Table(
    registry='loc_opt.inner.registry:OPTIMIZERS',
    key='optimizer.name',
    kwargs_key='optimizer.kwargs',
    first='Optimizer',
    computed=_STATE,
    rows={
        'sgd': Row('optax.sgd', _OPTAX, _LOCAL,
                   'the inner optimizer of the simplest baselines'),
        'momentum': Row('optax.sgd', _OPTAX, _LOCAL,
                        'SGD with heavy-ball momentum 0.9'),
        'adam': Row('optax.adam', _OPTAX, _LOCAL, 'as AdamW, without decay'),
        'adamw': Row('optax.adamw', _OPTAX, _LOCAL,
                     'the default inner optimizer of DiLoCo'),
        'lion': Row('optax.lion', _OPTAX, _LOCAL,
                    'half of Adam\'s state, sign updates'),
        'adafactor': Row('optax.adafactor', _OPTAX, _LOCAL,
                         'factored second moments: little state'),
        'spam': Row(
            'loc_opt.inner.spam',
            'Huang et al., *SPAM: Spike-Aware Adam with Momentum Reset for '
            'Stable LLM Training*, ICLR 2025', _LOCAL,
            'gradient spikes: clips spiked entries and resets the moments '
            'periodically'),
        'stable_spam': Row(
            'loc_opt.inner.stable_spam',
            'Huang et al., *Stable-SPAM: How to Train in 4-Bit More Stably '
            'than 16-Bit Adam*, 2025', _LOCAL,
            'spikes and low precision: adaptive clipping and gradient-norm '
            'scaling on top of SPAM'),
        'swan': Row(
            'loc_opt.inner.swan',
            'Ma, Gong, Scetbon, Meeds, *SWAN: SGD with Normalization and '
            'Whitening Enables Stateless LLM Training*, ICML 2025', _LOCAL,
            'memory: no moments, whitened matrix updates'),
        'frugal': Row(
            'loc_opt.inner.frugal',
            'Zmushko, Beznosikov, Takáč, Horváth, *FRUGAL: Memory-Efficient '
            'Optimization by Reducing State Overhead for Scalable Training*, '
            'ICML 2025', _LOCAL,
            'memory: Adam on a subspace, signSGD on the rest (the default '
            '``projector=\'blockwise\'`` keeps full-size moments here)',
            {'projector': 'columns'}),
        'fira': Row(
            'loc_opt.inner.fira',
            'Chen et al., *Fira: Can We Achieve Full-rank Training of LLMs '
            'Under Low-rank Constraint?*, 2024', _LOCAL,
            'memory: low-rank Adam state, full-rank updates'),
        'dion': Row(
            'loc_opt.inner.dion',
            'Ahn et al., *Dion: Distributed Orthonormalized Updates*, 2025',
            _LOCAL, 'orthonormalized (Muon-like) updates at low rank'),
        'drop_muon': Row(
            'loc_opt.inner.drop_muon',
            'Gruntkowska, Maziane, Qu, Richtárik, *Drop-Muon: Update Less, '
            'Converge Faster*, 2025', _LOCAL,
            'Muon that updates a random subset of layers each step'),
        'muon_adamw': Row(
            'loc_opt.inner.muon_adamw',
            'Thérien, Huang, Rish, Belilovsky, *MuLoCo: Muon is a practical '
            'inner optimizer for DiLoCo*, 2025', _LOCAL,
            'MuLoCo: Muon on hidden matrices, AdamW on the rest, chosen by '
            'parameter path'),
        'multi_timescale_adam': Row(
            'loc_opt.inner.multi_timescale_adam',
            'Iacob et al., *MT-DAO: Multi-Timescale Distributed Adaptive '
            'Optimizers with Local Updates*, 2025', _LOCAL,
            'with ``outer.method=\'mt_dao\'``: slow momenta mixed into the '
            'step'),
        'schedule_free_adamw': Row(
            'loc_opt.schedules.schedule_free_adamw',
            'Defazio et al., *The Road Less Scheduled*, NeurIPS 2024',
            _LOCAL,
            'no decay schedule to choose; evaluate at '
            ':func:`~loc_opt.schedules.schedule_free_eval_params`'),
        'schedule_free_sgd': Row(
            'loc_opt.schedules.schedule_free_sgd',
            'Defazio et al., *The Road Less Scheduled*, NeurIPS 2024',
            _LOCAL, 'as schedule-free AdamW, with SGD'),
    },
)

# -------------------------------------------------------------- schedules

_NO_BYTES = '0: a function of the step'
_WSD = ('Hägele et al., *Scaling Laws and Compute-Optimal Training Beyond '
        'Fixed Training Durations*, 2024; Hu et al., *MiniCPM*, 2024')

SCHEDULES = Table(
    registry='loc_opt.schedules.base:SCHEDULES',
    key='optimizer.schedule',
    first='Schedule',
    rows={
        'constant': Row('loc_opt.schedules.constant_schedule', 'baseline',
                        _NO_BYTES, 'ablations; with schedule-free'),
        'warmup_linear': Row(
            'loc_opt.schedules.warmup_linear_schedule',
            'Defazio et al., *When, Why and How Much? Adaptive Learning '
            'Rate Scheduling by Refinement*, 2023', _NO_BYTES,
            'a strong default when the run length is known'),
        'warmup_cosine': Row(
            'loc_opt.schedules.warmup_cosine_schedule',
            'Loshchilov, Hutter, *SGDR*, 2016', _NO_BYTES,
            'the common default when the run length is known'),
        'warmup_constant': Row(
            'loc_opt.schedules.warmup_constant_schedule', _WSD, _NO_BYTES,
            'the stable phase of WSD, to branch decays from later'),
        'linear_decay': Row(
            'loc_opt.schedules.linear_decay_schedule', _WSD, _NO_BYTES,
            'a decay branch from a checkpoint of a constant run'),
        'wsd': Row(
            'loc_opt.schedules.wsd_schedule', _WSD, _NO_BYTES,
            'the run length is not known in advance: decay at the end '
            '(``1-sqrt`` shape)'),
        'wsds': Row(
            'loc_opt.schedules.wsds_schedule',
            'Wen et al., *Understanding Warmup-Stable-Decay Learning Rates: '
            'A River Valley Loss Landscape Perspective*, 2024', _NO_BYTES,
            'several checkpoints along one run, each with its own decay'),
        'cosine_restarts': Row(
            'loc_opt.schedules.cosine_restarts_schedule',
            'Loshchilov, Hutter, *SGDR: Stochastic Gradient Descent with '
            'Warm Restarts*, 2016', _NO_BYTES,
            'periodic restarts (SGDR)'),
    },
)

SYNC_SCHEDULES = Table(
    registry='loc_opt.schedules.sync:SYNC_SCHEDULES',
    key='outer.sync_schedule',
    first='Sync schedule',
    rows={
        'constant': Row('loc_opt.schedules.constant_sync_schedule', _DILOCO,
                        'the method\'s payload every ``H`` steps',
                        'the default'),
        'step': Row('loc_opt.schedules.step_sync_schedule', 'baseline',
                    'the method\'s payload; ``H`` grows at the given steps',
                    'fewer syncs late in training'),
        'qsr': Row(
            'loc_opt.schedules.qsr_sync_schedule',
            'Gu, Lyu, Arora, Zhang, Huang, *A Quadratic Synchronization '
            'Rule for Distributed Deep Learning*, ICLR 2024',
            'the method\'s payload; ``H`` grows as the learning rate '
            'decays (``H ~ 1/lr^2``)',
            'decaying learning rates: fewer syncs, often better '
            'generalization'),
    },
)

# ------------------------------------------------------------ compression

_QUANT = ('Dettmers et al., *8-bit Optimizers via Block-wise '
          'Quantization*, 2022 (block-wise absmax)')
_SR = ('; stochastic rounding: Gupta et al., *Deep Learning with Limited '
       'Numerical Precision*, 2015')
_BLOCK = ' + one fp32 scale per 256 values'
_FP8 = ('Micikevicius et al., *FP8 Formats for Deep Learning*, 2022')
_FP4 = ('Rouhani et al., *Microscaling Data Formats for Deep Learning*, '
        '2023')
_STREAMING = ('Douillard et al., *Streaming DiLoCo with overlapping '
              'communication*, 2025 (fp4 e3m0)')
_MULOCO = ('Thérien, Huang, Rish, Belilovsky, *MuLoCo: Muon is a practical '
           'inner optimizer for DiLoCo*, 2025')


def _quant(name: str, bits: str, paper: str, use: str) -> dict[str, Row]:
  fn = 'loc_opt.compression.' + name.split('_')[0] + '_codec'
  rows = {name: Row(fn, paper, f'{bits}{_BLOCK}', use)}
  rows[name + '_sr'] = Row(fn, paper + _SR, f'{bits}{_BLOCK}',
                           'as ' + name + ', unbiased rounding')
  return rows


CODECS = Table(
    registry='loc_opt.compression.registry:CODECS',
    key='outer.codec',
    kwargs_key='outer.codec_kwargs',
    first='Codec',
    computed=('B/param (computed)', _codec_bytes),
    rows={
        'none': Row('loc_opt.compression.identity', 'baseline: fp32', '``4N``',
                    'no compression'),
        **_quant('int8', '``N`` int8', _QUANT,
                 '4x fewer bytes at no loss cost in :doc:`../benchmarks` '
                 '(data parallel and DiLoCo)'),
        **_quant('int4', '``N/2`` (4-bit codes)', _QUANT,
                 '8x: a uniform 4-bit grid (fp4 puts more levels near 0)'),
        **_quant('fp8_e4m3', '``N`` fp8', _FP8, 'as int8, floating point'),
        **_quant('fp8_e5m2', '``N`` fp8', _FP8,
                 'fp8 with a wider range, fewer mantissa bits'),
        **_quant('fp4_e2m1', '``N/2`` fp4', _FP4,
                 '8x: the microscaling fp4 format, finer near the scale '
                 'than e3m0'),
        **_quant('fp4_e3m0', '``N/2`` fp4', _STREAMING,
                 '8x: Streaming DiLoCo\'s format; +0.004 loss on DiLoCo\'s '
                 'pseudo-gradients in :doc:`../benchmarks`'),
        'two_bit': Row(
            'loc_opt.compression.two_bit_codec',
            'Sarfi et al., *SparseLoCo*, 2025 (2-bit values)',
            '``N/4`` + 20 B per 256 values (the mean and a 4-entry table)',
            '16x before the metadata, with error feedback'),
        'topk': Row(
            'loc_opt.compression.topk_codec',
            'Aji, Heafield, *Sparse Communication for Distributed Gradient '
            'Descent*, 2017',
            '``density N`` values + indices (8 B each in fp32 + int32)',
            'large ratios with error feedback', {'density': 0.01}),
        'topk_chunked': Row(
            'loc_opt.compression.sparse.topk_chunked_codec',
            'Sarfi et al., *SparseLoCo*, 2025 (top-k per chunk)',
            '``density N`` values + indices of at most 12 bits (within a '
            'chunk)',
            'top-k with short indices; combine with ``value_codec`` for '
            'SparseLoCo-like payloads', {'density': 0.01}),
        'randomk': Row(
            'loc_opt.compression.randomk_codec',
            'Stich, Cordonnier, Jaggi, *Sparsified SGD with Memory*, 2018',
            '``density N`` fp32 values (the mask is a shared seed)',
            'an all-reduce instead of an all-gather: the mask is shared',
            {'density': 0.01}),
    },
)

COMPRESSORS = Table(
    registry='loc_opt.compression.registry:COMPRESSORS',
    key='outer.codec',
    kwargs_key='outer.codec_kwargs',
    first='Compressor',
    computed=('B/param (computed)', _codec_bytes),
    rows={
        'powersgd': Row(
            'loc_opt.compression.powersgd',
            'Vogels, Karimireddy, Jaggi, *PowerSGD: Practical Low-Rank '
            'Gradient Compression for Distributed Optimization*, NeurIPS '
            '2019',
            '``4r(n + m)`` per ``n x m`` matrix (two all-reduces); other '
            'leaves ``4N``',
            'matrices; all-reduce friendly, error feedback built in '
            '(rank 4: 21x fewer bytes, +0.14 loss untuned in '
            ':doc:`../benchmarks`)',
            {'rank': 4}),
        'terngrad': Row(
            'loc_opt.compression.terngrad',
            'Wen et al., *TernGrad: Ternary Gradients to Reduce '
            'Communication in Distributed Deep Learning*, NIPS 2017',
            '``N/4`` (2 bits) + 4 B per leaf', 'unbiased 16x'),
        'dgc': Row(
            'loc_opt.compression.dgc',
            'Lin, Han, Mao, Wang, Dally, *Deep Gradient Compression: '
            'Reducing the Communication Bandwidth for Distributed '
            'Training*, ICLR 2018',
            '``density (4 + 4) N``: fp32 values and int32 indices',
            'every-step gradient compression with momentum correction'),
        'statistical': Row(
            'loc_opt.compression.statistical', _MULOCO,
            'per row: ``bits/8 N`` codes + a centroid table',
            'MuLoCo\'s 2-bit pseudo-gradients (with error feedback)'),
        'row_linear': Row(
            'loc_opt.compression.row_linear', _MULOCO,
            'per row: ``bits/8 N`` codes + minimum and maximum',
            'the uniform baseline of MuLoCo\'s quantizer'),
    },
)

FEEDBACK = Table(
    registry='loc_opt.compression.feedback:FEEDBACK',
    key='outer.error_feedback',
    first='Error feedback',
    rows={
        'none': Row('', 'baseline', 'the compressor\'s',
                    'exact or unbiased codecs'),
        'ef': Row(
            'loc_opt.compression.error_feedback',
            'Seide et al., *1-Bit Stochastic Gradient Descent*, 2014; '
            'Karimireddy et al., *Error Feedback Fixes SignSGD*, 2019',
            'the compressor\'s (the residual stays on the worker)',
            'biased codecs (top-k, 2-bit, fp4)'),
        'ef21': Row(
            'loc_opt.compression.ef21',
            'Richtárik, Sokolov, Fatkhullin, *EF21: A New, Simpler, '
            'Theoretically Better, and Practically Faster Error Feedback*, '
            '2021', 'the compressor\'s', 'compress the change of the value'),
        'econtrol': Row(
            'loc_opt.compression.econtrol',
            'Gao et al., *EControl: Fast Distributed Optimization with '
            'Compression and Error Control*, 2023', 'the compressor\'s',
            'strong compression where plain EF diverges'),
    },
)

# Table name -> table, as the directive ``registry-table`` names them.
TABLES: Mapping[str, Table] = {
    'outer': OUTER,
    'aggregate': AGGREGATES,
    'inner': INNER,
    'schedules': SCHEDULES,
    'sync_schedules': SYNC_SCHEDULES,
    'codecs': CODECS,
    'compressors': COMPRESSORS,
    'feedback': FEEDBACK,
}


def load(path: str) -> Any:
  """The object at ``'module:attr'`` or ``'module.attr'``."""
  module, _, attr = path.rpartition(':') if ':' in path else (
      path.rpartition('.'))
  return getattr(importlib.import_module(module), attr)


def registry_names(table: Table) -> list[str]:
  """The names the registry of ``table`` holds, in its order."""
  return list(load(table.registry))


def check(name: str) -> Table:
  """The table ``name``, after checking its rows against its registry.

  Raises:
    KeyError: for an unknown table name.
    ValueError: if a registered name has no row or a row no registered
      name; the message names them.
  """
  if name not in TABLES:
    raise KeyError(f'unknown registry table {name!r}; choose one of '
                   f'{sorted(TABLES)}')
  table = TABLES[name]
  names = registry_names(table)
  missing = [n for n in names if n not in table.rows]
  extra = [n for n in table.rows if n not in names]
  if missing or extra:
    raise ValueError(
        f'registry table {name!r} is out of date with {table.registry}: '
        f'registered without a row in docs/_ext/families.py: {missing}; '
        f'rows for names not registered: {extra}')
  return table


def rows(name: str) -> list[list[str]]:
  """The header and one row per registered name (reStructuredText cells),
  in the registry's order."""
  table = check(name)
  header = [table.first, 'Config key', 'Paper', 'Bytes per sync, per worker']
  if table.computed:
    header.append(table.computed[0])
  header.append('When to use')
  out = [header]
  for key in registry_names(table):
    row = table.rows[key]
    api = f':func:`~{row.api}`' if row.api else '--'
    config = f'``{table.key}=\'{key}\'``'
    if row.kwargs:
      config += f' with ``{table.kwargs_key}={dict(row.kwargs)!r}``'
    cells = [api, config, row.paper, row.bytes]
    if table.computed:
      cells.append(table.computed[1](key, row))
    cells.append(row.use)
    out.append(cells)
  return out


def rst_table(name: str) -> str:
  """The table ``name`` as a reStructuredText ``list-table``."""
  body = rows(name)
  lines = ['.. list-table::', '   :header-rows: 1', '   :class: registry',
           '']
  for row in body:
    lines.append(f'   * - {row[0]}')
    lines.extend(f'     - {cell}' for cell in row[1:])
  return '\n'.join(lines) + '\n'
