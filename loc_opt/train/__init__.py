"""The trainer: builds everything from a config, runs, checkpoints, logs.

Modules, each with one job (data flows down):

* ``config``: shared config fields to library objects (schedules, inner and
  outer optimizers, codecs, sync-period schedules).
* ``method`` / ``registry``: what the trainer needs of a method, and every
  method by name (``outer.method``).
* ``state`` / ``programs``: the train state's layout and the compiled
  per-phase programs.
* ``experiment``: validating a config and building all of the above.
* ``loop``: ``train_and_evaluate``, the loop with metrics, evaluation and
  checkpoints (``checkpoint``, ``metrics``).
* ``from_checkpoints``: WSD(-S) branches and WSM merges of saved runs.
"""

from loc_opt.train._deprecated import SyncPlan
from loc_opt.train.checkpoint import CheckpointError
from loc_opt.train.config import make_sync_every
from loc_opt.train.experiment import build_experiment
from loc_opt.train.experiment import data_parallel_bytes_per_step
from loc_opt.train.experiment import get_experiment
from loc_opt.train.experiment import validate_config
from loc_opt.train.from_checkpoints import branch_and_evaluate
from loc_opt.train.from_checkpoints import merge_and_evaluate
from loc_opt.train.loop import format_summary
from loc_opt.train.loop import train_and_evaluate
from loc_opt.train.metrics import read_metrics
from loc_opt.train.registry import get_method
from loc_opt.train.registry import METHODS
from loc_opt.train.spikes import inject_gradient_spikes
from loc_opt.train.spikes import spike_steps
