"""The small LM setup of the inner-optimizer and schedule experiments.

configs/diloco_lm.py's Transformer (2 layers, d_model 128) on shorter
sequences and a smaller batch, data-parallel on the 4 x 2 mesh, so one run
of 300 steps takes a minute or two on a 2-core machine. The experiment
programs override the optimizer, the schedule or the method per run and keep
the tokens equal across the runs they compare.

Launch (one run):
  python -m experiments.train --config=configs/inner_schedules_lm.py \\
    --workdir=DIR
The experiments:
  python -m experiments.schedules --workdir=DIR
  python -m experiments.spikes --workdir=DIR
  python -m experiments.inner_under_diloco --workdir=DIR
"""

import ml_collections

from configs import diloco_lm


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  """The diloco_lm config, smaller and data-parallel (``arg`` is unused)."""
  c = diloco_lm.get_config(arg)
  c.num_steps = 300  # Steps of every compared run (equal tokens).
  c.batch_size = 16  # Global sequences per step.
  c.data.seq_len = 64  # Bytes per training sequence.
  c.data.eval_batch_size = 32  # Sequences per evaluation batch.
  c.eval_batches = 4  # 4 x 32 x 64 bytes per evaluation.
  c.eval_every = 50  # Evaluate every this many steps (and at the end).
  c.log_every = 5  # Train loss every this many steps.
  c.checkpoint_every = 0  # Only the final checkpoint (runs override).
  c.keep_checkpoints = 2  # How many checkpoints to keep.
  c.progress = False  # The experiment programs print one line per run.
  c.outer.method = 'data_parallel'  # Inner-optimizer studies need no outer.
  # Every schedule decays to 0 (cosine, linear, WSD), warmup 10% of the run.
  c.optimizer.schedule_kwargs = {'warmup_steps': 0.1, 'end_value': 0.0}
  return c
