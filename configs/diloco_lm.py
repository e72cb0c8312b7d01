"""DiLoCo on the byte-level Transformer LM: 4 workers x 2 data-parallel devices.

The default experiment. On a machine without accelerators it runs on 8
virtual CPU devices, on text from the Python standard library, offline.

Launch (installed: ``pip install 'loc_opt[train]'``; in a clone,
``python -m experiments.train`` is the same program):
  loc-opt-train --config=diloco_lm --workdir=DIR
The same run on a 2-layer MLP bigram model instead (seconds to compile on a
CPU: smoke runs, tests):
  loc-opt-train --config=diloco_lm:mlp --workdir=DIR
Override any field, e.g.:
  loc-opt-train --config=diloco_lm --workdir=DIR \\
    --config.outer.sync_every=50 --config.num_steps=400
Every method runs from its name alone: --config.outer.method=NAME.
"""

import ml_collections

from loc_opt import data
from loc_opt.outer import hierarchical


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  """The DiLoCo LM config; ``arg`` picks the model: ``None`` or
  ``'transformer'`` (the default), or ``'mlp'`` (``loc_opt.models.MLP``
  on one-hot bytes)."""
  if arg not in (None, '', 'transformer', 'mlp'):
    raise ValueError(f"config argument {arg!r} is not a model: use "
                     "'transformer' (the default) or 'mlp', e.g. "
                     "--config=diloco_lm:mlp")
  c = ml_collections.ConfigDict()
  c.seed = 0  # Seed of the model initialisation and of the data order.
  c.num_steps = 300  # Inner (optimizer) steps of every worker.
  c.batch_size = 32  # Global sequences per step, split evenly over workers.
  c.eval_batches = 4  # Batches per evaluation (fixed validation set), >= 1.
  c.eval_every = 100  # Evaluate every this many steps and at the end (0: end).
  c.log_every = 10  # Write train metrics every this many steps (>= 1).
  c.checkpoint_every = 100  # Save every this many steps and at the end (0: end)
  c.keep_checkpoints = 2  # How many checkpoints to keep (>= 1).
  c.progress = True  # Progress bar on a terminal / log lines elsewhere.
  # Where metrics go: metrics.jsonl always (the summary and
  # `python -m loc_opt.plot` read it), plus any of 'tensorboard'
  # (tensorboard/), 'csv' (metrics.csv) and 'wandb' (a Weights & Biases run;
  # needs `pip install wandb`). May change on resume.
  c.logging = ml_collections.ConfigDict()
  c.logging.backends = ('jsonl', 'tensorboard')
  c.logging.wandb_project = 'loc_opt'  # W&B project.
  c.logging.wandb_name = ''  # W&B run name ('' = the workdir's name).
  c.logging.wandb_mode = 'online'  # 'online', 'offline' or 'disabled'.
  c.halt_after_steps = 0  # Stop after this many steps (simulated preemption).
  # Start from another run's checkpoint (a WSD / WSD-S decay branch, see
  # loc_opt.train.branch_and_evaluate); used only while workdir has none.
  c.init_from = ml_collections.ConfigDict()
  c.init_from.workdir = ''  # The other run's workdir ('' = start fresh).
  c.init_from.step = 0  # Its checkpoint step to start from (< num_steps).

  c.mesh = ml_collections.ConfigDict()
  c.mesh.workers = 4  # DiLoCo workers: the outermost mesh axis.
  c.mesh.data = 2  # Data-parallel devices inside a worker.
  c.mesh.fsdp = 1  # Devices a worker's parameters are sharded over.
  c.mesh.tensor = 1  # Tensor-parallel devices inside a worker.
  # True: the mesh.workers workers are stacked on shared devices (jax.vmap
  # over a named worker axis) instead of each having its own, so M workers
  # run on one GPU or CPU. The devices form groups of data * fsdp * tensor;
  # with one group every worker is on every device and no collective
  # crosses devices (no bytes measured); with G groups (G dividing M, e.g.
  # one per process: --local_processes) each holds M / G workers and only
  # the syncs cross groups. Same numerics.
  c.mesh.simulate_workers = False

  c.model = ml_collections.ConfigDict()
  c.model.name = 'transformer'  # Or 'mlp': --config=diloco_lm:mlp.
  c.model.vocab_size = 256  # Byte-level vocabulary.
  c.model.d_model = 128  # Residual width.
  c.model.num_layers = 2  # Transformer blocks.
  c.model.num_heads = 4  # Attention heads (d_model % num_heads == 0).
  c.model.d_ff = 512  # Hidden width of the MLP.
  c.model.max_len = 128  # Longest sequence the model accepts.
  c.model.dtype = 'float32'  # Activation dtype.
  c.model.param_dtype = 'float32'  # Parameter dtype.
  # Mixed precision at scale: dtype='bfloat16' with param_dtype='float32'
  # (bf16 matmul operands, f32 accumulation, softmax, norms, loss, params).
  # Attention: 'einsum' (explicit formula), or jax.nn.dot_product_attention
  # with implementation 'auto' (JAX picks), 'xla' or 'cudnn' (GPU).
  c.model.attention = 'einsum'
  # Logical axis -> mesh axes, for parameters and activations alike
  # (loc_opt.models.sharding): a dimension takes the listed mesh axes that
  # exist, are not manual and are not taken by an earlier dimension.
  c.model.axis_rules = ml_collections.ConfigDict({
      'batch': ('worker', 'data', 'fsdp'),  # Activations' batch dimension.
      'length': (),  # Sequence positions: not split.
      'embed': ('fsdp',),  # d_model: FSDP for parameters.
      'mlp': ('tensor',),  # MLP hidden units (Megatron).
      'heads': ('tensor',),  # Attention heads (Megatron).
      'kv': (),  # Features of one head.
      'vocab': ('tensor',),  # Vocabulary (vocabulary-parallel loss).
      'layers': (),  # Stacking axis of scanned blocks.
      'expert': ('fsdp',),  # MoE experts (expert parallelism in a worker).
  })
  # Blocks as one stacked subtree applied by jax.lax.scan (compile time flat
  # in depth); False keeps layer_0 ... layer_{L-1}, which Streaming DiLoCo's
  # fragments need.
  c.model.scan_layers = False
  # Rematerialization of each block: 'none', 'full', 'dots', 'dots_no_batch',
  # 'full_tp' ('full' keeping the attention output: no all-reduce recomputed
  # on a tensor mesh).
  c.model.remat = 'none'
  # Gradients that contract over the tokens (dense and embedding weights,
  # float32 attention keys and values): 'auto' (the narrow-transpose custom
  # VJPs on CPU, JAX's rules elsewhere), 'xla' or 'narrow'
  # (loc_opt.models.weight_grad; same products, faster on XLA:CPU).
  c.model.weight_grad = 'auto'
  # Backward rules of RMSNorm, GELU and (with weight_grad narrow) RoPE:
  # 'auto' ('fused' on CPU, 'xla' elsewhere), 'xla' (JAX's) or 'fused'
  # (loc_opt.models.fused_backward; one pass each, float32; faster on
  # XLA:CPU, gradients equal to JAX's rules to float32 rounding).
  c.model.backward = 'auto'
  # Query blocks of the causal attention under those rules, skipping the
  # scores above the diagonal's blocks: 'auto' (2 in a CPU process on one
  # core, else 1) or a count (loc_opt.models.attention).
  c.model.causal_blocks = 'auto'
  # Mixture-of-Experts (loc_opt.models.moe, docs/moe.md): num_experts > 0
  # replaces every block's MLP by experts of width d_ff and a router.
  c.model.moe = ml_collections.ConfigDict()
  c.model.moe.num_experts = 0  # Experts per block (0: the dense MLP).
  c.model.moe.top_k = 1  # Experts per token: 1 (Switch) or 2 (GShard).
  # Slots per expert and sequence: ceil(factor * seq_len * top_k / experts);
  # assignments past them are dropped (metrics routing/dropped); <= 0: none.
  c.model.moe.capacity_factor = 1.25
  c.model.moe.balance_loss = 0.01  # Load-balancing loss coefficient.
  c.model.moe.z_loss = 0.001  # Router z-loss coefficient.
  c.model.moe.shared_expert = False  # Also a dense MLP every token passes.
  # 'all_to_all': tokens reach the experts' devices by all-to-alls (GShard);
  # 'xla': the partitioner's own layout (same values; docs/moe.md).
  c.model.moe.dispatch = 'all_to_all'

  # Data fields and their meaning: loc_opt.data.get_config().
  c.data = data.get_config()
  c.data.dataset = 'local_text'  # 'local_text' or a TFDS name in data_dir.
  c.data.max_bytes = 8_000_000  # Cap on the stdlib corpus (bytes).
  c.data.non_iid = False  # True: whole source files per worker.
  c.data.seq_len = 128  # Bytes per training sequence.
  c.data.eval_batch_size = 32  # Sequences per evaluation batch.

  c.optimizer = ml_collections.ConfigDict()
  c.optimizer.name = 'adamw'  # Inner optimizer (loc_opt.inner.OPTIMIZERS).
  c.optimizer.learning_rate = 3e-3  # Peak inner learning rate (>= 0).
  c.optimizer.schedule = 'warmup_cosine'  # loc_opt.schedules.SCHEDULES.
  # Warmup: a float is a fraction of num_steps in [0, 1), an int a step count.
  c.optimizer.schedule_kwargs = {'warmup_steps': 0.1,  # Warmup (fraction).
                                 'end_value': 3e-4}  # Final learning rate.
  c.optimizer.grad_clip_norm = 1.0  # Global-norm clip of inner grads.
  c.optimizer.kwargs = {'b1': 0.9, 'b2': 0.95,  # Adam betas.
                        'weight_decay': 0.1}  # Decoupled weight decay.
  # Injected gradient spikes (loc_opt.train.spikes), first in the inner
  # chain, before grad_clip_norm (which clips them back: set it to 0 to let
  # them through). Off when spike_num is 0.
  c.optimizer.spike_num = 0  # How many steps get a spiked gradient.
  c.optimizer.spike_scale = 1000.0  # Gradient multiplier on those steps.
  c.optimizer.spike_seed = 0  # Seed of the spiked steps.
  c.optimizer.spike_window = (0.2, 0.8)  # Fractions of the run to spike in.

  c.outer = ml_collections.ConfigDict()
  # A name of loc_opt.train.METHODS: 'diloco', 'local_sgd', 'data_parallel',
  # 'compressed_data_parallel', or one of the DiLoCo family below, each with
  # its section outer.<method>: 'streaming_diloco', 'eager_diloco', 'noloco',
  # 'demo', 'sparseloco', 'desloc', 'mt_dao', 'async_local_sgd',
  # 'edit_diloco', 'co2', 'decoupled_diloco', 'hierarchical_diloco'.
  c.outer.method = 'diloco'
  c.outer.sync_every = 50  # H: inner steps between syncs (<= num_steps).
  # How H changes over the run: a name of loc_opt.schedules.SYNC_SCHEDULES:
  # 'constant' (H = sync_every), 'step' or 'qsr' (H = max(sync_every,
  # floor((alpha / lr_t)^2)) from the inner learning-rate schedule).
  c.outer.sync_schedule = 'constant'
  # Its arguments, e.g. {'alpha': 0.02} for 'qsr' or
  # {'boundaries_and_periods': {'0': 50, '200': 100}} for 'step'.
  c.outer.sync_schedule_kwargs = {}
  c.outer.learning_rate = 0.7  # Outer learning rate (Nesterov SGD), >= 0.
  c.outer.momentum = 0.9  # Outer momentum, in [0, 1).
  c.outer.nesterov = True  # Nesterov (True) or heavy-ball momentum.
  # What crosses workers: a name of loc_opt.compression.make_compressor
  # ('none', 'int8', 'int4', 'fp4_e3m0', 'topk', 'powersgd', 'statistical',
  # 'row_linear', ...), for pseudo-gradients (DiLoCo) or gradients
  # (compressed_data_parallel).
  c.outer.codec = 'none'
  c.outer.codec_kwargs = {}  # The codec's arguments, e.g. {'rank': 4}.
  c.outer.error_feedback = 'none'  # 'none', 'ef', 'ef21' or 'econtrol'.
  c.outer.econtrol_eta = 0.1  # EControl's feedback strength.
  c.outer.ef_decay = 1.0  # 'ef' only: e <- ef_decay * (p - C(p)), in [0, 1].
  c.outer.compress_min_size = 0  # Smaller leaves are sent uncompressed.
  # Leaves whose path contains one of these (case-insensitive) are sent
  # uncompressed in fp32, without error feedback, e.g. ('norm', 'embed',
  # 'head') for MuLoCo's skip masks.
  c.outer.compress_skip = ()
  c.outer.compress_start_step = 0  # compressed_data_parallel: fp32 before.
  # How the workers' pseudo-gradients are combined (diloco, local_sgd,
  # streaming_diloco; loc_opt.outer.robust, docs/robust_aggregation.md):
  # 'mean' (an all-reduce), or a rule one bad worker cannot wreck:
  # 'median' / 'trimmed_mean' (coordinate-wise, an all-gather of every
  # worker's fp32 pseudo-gradient: no codec) or 'norm_clipped_mean' (each
  # clipped to aggregate_clip x the median norm, then the mean; takes a
  # codec). Absent and non-finite workers are left out.
  c.outer.aggregate = 'mean'
  c.outer.aggregate_trim = 1  # trimmed_mean: values dropped at each end.
  c.outer.aggregate_clip = 1.0  # norm_clipped_mean: bound / median norm.
  # How a sync overlaps the steps after it (streaming_diloco with overlap
  # > 0, eager_diloco, co2): 'none' (one program per step; the overlap is
  # in the numerics and the wall-clock model only) or 'compiled' (the sync
  # step and the steps that overlap its collective run as one program, so
  # XLA may hide the transfer behind them; same numbers). docs/overlap.md.
  c.outer.overlap = 'none'
  # Where the outer state (anchor, outer momentum) lives between syncs
  # (diloco, local_sgd; docs/sharding.md): 'replicated' (every worker holds
  # it whole), 'sharded' (each worker holds its 1/workers: reduce-scatter,
  # outer step on the shard, all-gather; ZeRO stage 1; no codec, robust
  # rule or change of mesh.workers on resume) or 'offloaded' (replicated,
  # in pinned host memory, moved to the device only by the sync program).
  c.outer.state_layout = 'replicated'

  # Per-method settings of the DiLoCo family (loc_opt.outer), one section
  # named after each method (outer.<method>); fields that a library function
  # also takes have its default here (tests/train/test_registry.py checks
  # it). Each method also reads sync_every (H), learning_rate and momentum
  # above where it has an outer optimizer, and outer.codec where it sends
  # pseudo-gradients.
  # Streaming DiLoCo ('streaming_diloco'): fragments synced in turn.
  s = c.outer.streaming_diloco = ml_collections.ConfigDict()
  # P (embeddings/head + block groups); 0: the first of 3, 2, 1 that
  # divides sync_every (3 at H = 30, 2 at the default H = 50).
  s.num_fragments = 0
  # Blocks to fragments: 'strided', 'sequential', or 'balanced' (whole
  # tensors bin-packed by size: models without numbered blocks, e.g. :mlp).
  s.pattern = 'strided'
  s.overlap = 1  # tau: inner steps a fragment's sync overlaps.
  # Weight of the local fragment in the blend (None: 0.5 with overlap,
  # else 0).
  s.alpha = ml_collections.config_dict.placeholder(float)
  # Eager updates ('eager_diloco'): the average lands one round late.
  s = c.outer.eager_diloco = ml_collections.ConfigDict()
  s.naive = False  # True: the delayed average alone (ablation).
  # Its own outer step (None: outer.learning_rate / outer.momentum). With
  # DiLoCo's momentum 0.9, the (M-1)/M of each outer gradient that lands a
  # round late makes the outer recursion unstable at M = 4 (issue 17);
  # experiments.outer_sweep (300 steps, H = 30, lr 0.7, momenta 0.9 / 0.7 /
  # 0.5 / 0.3 / 0.1) found 0.3 best at M = 2 (1.8675 vs 2.1852 at 0.9; 0.1:
  # 1.8689) and 0.1 best at M = 4 (2.0095; 0.3: 2.0427; 0.9: 2.6888):
  # docs/benchmarks.md. 0.3 stays until the family table is rerun at 0.1.
  s.learning_rate = ml_collections.config_dict.placeholder(float)
  s.momentum = 0.3
  # NoLoCo ('noloco'): random peer groups, no all-reduce.
  s = c.outer.noloco = ml_collections.ConfigDict()
  # alpha (heavy-ball; lr is learning_rate). Its own, not DiLoCo's 0.9:
  # experiments.outer_sweep --results_name=outer_sweep_own (M = 4, 300
  # steps, H = 30, lr 0.7) gave momentum 0.9 2.1390, 0.5 1.9006, 0.3
  # 1.8815, 0.1 1.8906; 0.5 (the paper's) stays, 1% from the best on one
  # seed (docs/benchmarks.md).
  s.momentum = 0.5
  # gamma (None: equal to learning_rate).
  s.consensus = ml_collections.config_dict.placeholder(float)
  s.group_size = 2  # Workers per group.
  s.seed = 0  # Seed of the pairings (shared by all workers).
  # DeMo ('demo'): every step, top-k DCT components of momentum, sign step.
  # Replaces the inner optimizer (optimizer.name, grad_clip_norm and spikes
  # do not apply); its learning rate is the inner schedule x lr_scale.
  s = c.outer.demo = ml_collections.ConfigDict()
  s.beta = 0.999  # Momentum decay.
  s.topk = 32  # Coefficients kept per chunk x chunk block.
  s.chunk = 64  # DCT block edge.
  s.lr_scale = 1.0  # Multiplies the inner learning rate.
  s.weight_decay = 0.0  # Decoupled weight decay.
  # SparseLoCo ('sparseloco'): error feedback, tile top-k, 2-bit values.
  s = c.outer.sparseloco = ml_collections.ConfigDict()
  s.ef_decay = 0.95  # Error-feedback decay.
  s.topk = 128  # Kept per 64 x 64 tile (scaled for others).
  s.tile = 64  # Tile edge.
  s.value_codec = 'two_bit'  # Or 'none' (fp32 values).
  s.learning_rate = 1.0  # Outer SGD learning rate.
  # 'mean_of_selected' (reference) or 'mean_over_workers'.
  s.aggregate = 'mean_of_selected'
  # DES-LOC ('desloc') and MT-DAO ('mt_dao'): a period per optimizer state;
  # 0 = a multiple of sync_every (DES-LOC: 3x for mu, 6x for nu; MT-DAO: 1x).
  # MT-DAO runs optimizer.name = 'multi_timescale_adam'; with the default
  # 'adamw' it uses multi_timescale_adam's slow momenta and adamw's b2,
  # weight_decay, clip and schedule.
  s = c.outer.desloc = ml_collections.ConfigDict()
  s.mu_sync_every = 0  # First moment (DES-LOC).
  s.nu_sync_every = 0  # Second moment.
  s.slow_sync_every = 0  # Slow momenta (MT-DAO).
  s.nesterov = False  # Outer Nesterov on params, not averaging.
  # When due states are averaged: 'before_update' (the paper's order: the
  # old moments and parameters, before the moment update) or 'after_update'
  # (the step on local states, then the means; DiLoCo's sync).
  s.average_at = 'before_update'
  # Coordinate-wise gradient clip radius before the moments (the paper's
  # clip; it gives no radius, 1.0 is ours); None: no clip.
  s.clip_radius = 1.0
  # Asynchronous local SGD ('async_local_sgd'), simulated: worker speeds are
  # wallclock.worker_speeds; server: Delayed Nesterov (learning_rate,
  # momentum above).
  s = c.outer.async_local_sgd = ml_collections.ConfigDict()
  s.dylu = True  # Slower workers take fewer inner steps.
  s.buffer_size = 0  # DN's N (0 = number of workers).
  s.activation = 0.0  # DN's c, in [0, 1/N].
  # EDiT ('edit_diloco'): DiLoCo with a pseudo-gradient penalty (outer step:
  # learning_rate, momentum above).
  s = c.outer.edit_diloco = ml_collections.ConfigDict()
  s.ewma = 0.02  # EWMA rate of each worker's norm statistics.
  s.warmup_syncs = 120  # Syncs before anomalies are dropped.
  s.z_threshold = 3.0  # Norm z-score that drops a worker.
  s.temperature = 1.0  # Softmax temperature of the weights.
  # Clip of the averaged delta (None: no clip).
  s.clip_norm = ml_collections.config_dict.placeholder(float)
  # CO2 ('co2'): local SGD whose outer step uses the previous round's
  # average, so the all-reduce overlaps a whole round.
  s = c.outer.co2 = ml_collections.ConfigDict()
  # Its own outer step, not DiLoCo's (0.7 / 0.9): the one-round-stale step
  # is hurt by momentum 0.9. experiments.outer_sweep
  # --results_name=outer_sweep_own (M = 4, 300 steps, H = 30, lr 0.7):
  # momentum 0.9 2.2058, 0.5 2.0784, 0.3 2.0645, 0.1 2.0664; the paper's
  # lr 1.0 / momentum 0.5 below ends at 2.0569 in the family table.
  s.learning_rate = 1.0  # Outer learning rate.
  s.momentum = 0.5  # Outer momentum.
  s.staleness_penalty = 1.0  # lambda.
  s.clip = 1.0  # Element-wise clip of the momentum (0 = none).

  # Decoupled DiLoCo ('decoupled_diloco'): learners on their own clocks
  # (speeds: wallclock.worker_speeds; failures: faults.failures / chaos); a
  # syncer merges each fragment once `quorum` learners reported, after a
  # grace window. Outer step: learning_rate, momentum above, per fragment.
  # See docs/decoupled_diloco.md.
  s = c.outer.decoupled_diloco = ml_collections.ConfigDict()
  s.num_fragments = 2  # P: balanced bins of whole tensors (H % P == 0).
  s.overlap = 2  # tau: inner steps a sync may overlap (the grace slack).
  s.quorum = 1  # K: learners needed before a fragment merges.
  s.grace = 0.2  # gamma: fraction of the slack to wait after quorum.
  s.grace_cap = 1.0  # Longest grace window, in steps of the fastest.
  s.sync_steps = 1.0  # Steps from a merge to its arrival at the learners.
  s.jitter = 0.0  # Std of the log of each inner step's duration.
  s.merge = 'rda'  # 'rda' (embeddings averaged) or 'average'.
  s.rda_scope = 'leaf'  # RDA per 'leaf' or per 'fragment'.
  s.weighting = 'tokens'  # tokens^2 / steps per learner, or 'uniform'.
  s.alpha = 0.0  # Weight of the local copy on receipt (0: overwrite).
  s.rejoin_state = 'keep'  # A returning learner's inner state: or 'fresh',
  # 'peer' (copied from a live learner).

  # Hierarchical DiLoCo ('hierarchical_diloco'): groups of group_size
  # consecutive workers sync every sync_every steps (H1; outer step:
  # learning_rate, momentum above); every global_period x H1 steps (H2) the
  # groups merge (global outer step below, through outer.codec). Only that
  # merge crosses groups. See docs/hierarchical.md.
  s = c.outer.hierarchical_diloco = ml_collections.ConfigDict()
  s.group_size = 2  # G: workers per group; divides mesh.workers.
  s.global_period = 2  # H2 / H1: group syncs per global sync.
  # Global outer step: the library's defaults (hierarchical_diloco's
  # outer=None), SGD at rate 1 with no momentum, a plain merge.
  s.global_learning_rate = hierarchical.GLOBAL_LEARNING_RATE
  s.global_momentum = hierarchical.GLOBAL_MOMENTUM  # > 0: Nesterov.
  # Who sends across groups: 'all' (an all-reduce over every worker) or
  # 'representatives' (TreeLoCo: each group's first worker; no outer.codec).
  s.global_exchange = 'all'
  # What crosses workers inside a group: 'none' (fp32) or a name of
  # loc_opt.compression.make_compressor ('int8', 'fp4_e3m0', 'statistical',
  # ...); its payloads move by G - 1 shifts inside the group.
  s.group_codec = 'none'
  s.group_codec_kwargs = {}  # Its arguments, e.g. {'bits': 2}.
  # Error feedback of the group codec, per worker: 'none', 'ef', 'ef21' or
  # 'econtrol' (needs group_codec).
  s.group_error_feedback = 'none'
  s.group_ef_decay = 1.0  # 'ef' only: e <- decay * (p - C(p)), in [0, 1].

  # A parameter group on a sync period of its own ('group_diloco'): the
  # leaves whose path matches `pattern` (default: a MoE LM's routers) sync
  # every sync_every steps with their own outer step; the rest every
  # outer.sync_every steps with the outer step above. See docs/moe.md.
  s = c.outer.group_diloco = ml_collections.ConfigDict()
  s.pattern = r'(^|/)router/'  # re.search on 'layer_0/mlp/router/kernel'.
  s.sync_every = 2  # H_g: the group's period (a positive int).
  s.learning_rate = 0.7  # The group's outer learning rate.
  s.momentum = 0.9  # Its Nesterov momentum (0: plain SGD).

  # Non-finite steps (loc_opt.train.faults): a worker skips an inner step
  # whose loss or gradients are NaN / Inf (zeros them on a step that syncs);
  # bad steps are counted (metrics faults/bad_steps).
  c.faults = ml_collections.ConfigDict()
  # Stop after this many consecutive bad steps on a worker (0: never);
  # checked every log_every steps.
  c.faults.max_bad_steps = 10
  c.faults.nan_grad_steps = ()  # Inject NaN gradients at these steps...
  c.faults.nan_grad_workers = ()  # ...on these workers (() = every worker).
  c.faults.nan_param_steps = ()  # NaN parameters at these steps...
  c.faults.nan_param_workers = ()  # ...on these workers (() = every worker).
  # Worker dropout (diloco, local_sgd, streaming_diloco): these workers miss
  # the syncs numbered drop_syncs (0 = first sync); their pseudo-gradients
  # are left out of the mean, which is over the present workers, and they
  # rejoin from the new anchor (metrics faults/left_out).
  c.faults.drop_syncs = ()
  c.faults.drop_workers = ()
  # And at this fraction of the syncs (drawn from the seed) one worker,
  # drawn too, misses the sync.
  c.faults.drop_fraction = 0.0
  # Learner failures (decoupled_diloco): (worker, start step, steps down)
  # triples; a returning learner rejoins from the global fragments.
  c.faults.failures = ()
  # And a chaos model: each chip of a learner fails after exponential times
  # with this mean (steps; 0 = off), so a learner of chaos_chips_per_learner
  # chips fails that many times as often, and stays down
  # chaos_downtime_steps.
  c.faults.chaos_mtbf_steps = 0.0
  c.faults.chaos_chips_per_learner = 1
  c.faults.chaos_downtime_steps = 0.0
  # Slow machines: seconds a process sleeps after each step, one value for
  # every process or one per process (() = none).
  c.faults.step_sleep_s = ()

  # The simulated machine of the wall-clock model (loc_opt.parallel.wallclock):
  # the run's compiled collectives are played against these links; the
  # summary reports simulated seconds and compute utilization per bandwidth.
  c.wallclock = ml_collections.ConfigDict()
  c.wallclock.step_time_s = 0.1  # Compute seconds of one step (fastest).
  c.wallclock.bandwidths_gbps = (1.0, 100.0)  # Links between workers.
  c.wallclock.latency_s = 0.001  # Seconds to start one message.
  # Project the bytes to a model of this many parameters (0 = this model).
  c.wallclock.model_params = 0
  # Relative speed of each worker (fastest = 1; () = all equal). Synchronous
  # methods run at the slowest worker's pace; async_local_sgd simulates
  # these speeds in its numerics too.
  c.wallclock.worker_speeds = ()
  if arg == 'mlp':
    c.model = mlp_model()
    # No numbered blocks to stream: whole tensors by size.
    c.outer.streaming_diloco.pattern = 'balanced'
  return c


def mlp_model() -> ml_collections.ConfigDict:
  """The ``model`` section of ``loc_opt.models.MLP`` as a byte-level bigram
  LM: one-hot bytes -> ``hidden`` -> next-byte logits (4 parameter leaves;
  the trainer tests' steps compile in about 40% of a 1-block Transformer's
  time)."""
  m = ml_collections.ConfigDict()
  m.name = 'mlp'
  m.in_dim = 256  # One-hot bytes.
  m.hidden = 128  # Hidden width.
  m.out_dim = 256  # Next-byte logits.
  m.num_layers = 2  # Dense layers (GELU between them).
  m.dtype = 'float32'  # Activation dtype.
  m.param_dtype = 'float32'  # Parameter dtype.
  return m
