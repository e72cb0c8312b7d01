"""Decoupled DiLoCo on the byte-level Transformer LM, under stragglers and a
failure.

Derived from configs/diloco_lm.py (same model, data, inner AdamW and 4 x 2
mesh). Four learners on their own clocks: two run at 0.6x the speed of the
others (``wallclock.worker_speeds``), and learner 1 fails at step 100 and
comes back 100 steps later (``faults.failures``). The model is split into
P = 2 balanced fragments, each merged every H = 30 steps once one learner
reported (quorum K = 1) plus a grace window of 0.2 x the slack; merges
weight learners by tokens^2 / steps and use radial-directional averaging
(the input embedding averaged directly). See docs/decoupled_diloco.md.

Reference: Douillard et al., *Decoupled DiLoCo for Resilient Distributed
Pre-training*, 2026 (arXiv 2604.21428).

Launch:
  python -m experiments.train --config=configs/decoupled_diloco_lm.py \\
    --workdir=DIR
Wait for every live learner (quorum = M), or a chaos model instead of the
scripted failure:
  ... --config.outer.decoupled_diloco.quorum=4
  ... --config.faults.failures='()' --config.faults.chaos_mtbf_steps=150 \\
    --config.faults.chaos_downtime_steps=30
"""

import ml_collections

from configs import diloco_lm


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  """The DiLoCo LM config run as Decoupled DiLoCo with two slow learners and
  one failure (``arg`` is unused)."""
  c = diloco_lm.get_config(arg)
  c.outer.method = 'decoupled_diloco'
  c.outer.sync_every = 30  # H: each fragment merges every 30 steps.
  c.outer.decoupled_diloco.num_fragments = 2  # P (S = H / P = 15).
  c.eval_every = 25  # Evaluate often: loss vs tokens and simulated time.
  c.wallclock.worker_speeds = (1.0, 1.0, 0.6, 0.6)  # Two slow learners.
  # Learner 1 is down for steps 100-199 and rejoins at step 200.
  c.faults.failures = ((1, 100, 100),)
  return c
