"""The trainer: builds everything from a config, runs, checkpoints, logs."""

from loc_opt.train.checkpoint import CheckpointError
from loc_opt.train.from_checkpoints import branch_and_evaluate
from loc_opt.train.from_checkpoints import merge_and_evaluate
from loc_opt.train.methods import METHODS
from loc_opt.train.methods import SyncPlan
from loc_opt.train.metrics import read_metrics
from loc_opt.train.spikes import inject_gradient_spikes
from loc_opt.train.spikes import spike_steps
from loc_opt.train.trainer import build_experiment
from loc_opt.train.trainer import data_parallel_bytes_per_step
from loc_opt.train.trainer import format_summary
from loc_opt.train.trainer import get_experiment
from loc_opt.train.trainer import train_and_evaluate
from loc_opt.train.trainer import validate_config
