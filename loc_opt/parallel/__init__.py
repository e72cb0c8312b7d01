"""Meshes with a worker axis, per-worker runners, collective accounting, and
the goodput of training policies under chip failures."""

from loc_opt.parallel.collectives import worker_mean
from loc_opt.parallel.mesh import AXES
from loc_opt.parallel.mesh import arrange_devices
from loc_opt.parallel.mesh import check_process_layout
from loc_opt.parallel.mesh import devices_per_worker
from loc_opt.parallel.mesh import make_worker_mesh
from loc_opt.parallel.mesh import num_workers
from loc_opt.parallel.mesh import WORKER
from loc_opt.parallel.offload import host_shardings
from loc_opt.parallel.offload import offloaded
from loc_opt.parallel.runners import replicate
from loc_opt.parallel.runners import runs_under_vmap
from loc_opt.parallel.runners import shard_map_workers
from loc_opt.parallel.runners import vmap_workers
from loc_opt.parallel import goodput
from loc_opt.parallel import ideal
from loc_opt.parallel import kernels
from loc_opt.parallel.hlo import Collective
from loc_opt.parallel.hlo import collective_bytes
from loc_opt.parallel.hlo import CollectiveReport
from loc_opt.parallel.dataflow import collective_dataflow
from loc_opt.parallel.dataflow import CollectiveDataflow
from loc_opt.parallel.overlap import overlap_window
from loc_opt.parallel.schedule import collective_schedule
from loc_opt.parallel.schedule import CollectiveSpan
from loc_opt.parallel.hlo import host_arguments
from loc_opt.parallel.wallclock import Link
from loc_opt.parallel.wallclock import StepClock
from loc_opt.parallel.wallclock import WallClock
from loc_opt.parallel.wallclock import collective_seconds
from loc_opt.parallel.wallclock import cross_worker_transfers
from loc_opt.parallel.wallclock import simulate as simulate_wallclock
from loc_opt.parallel.wallclock import transfers_seconds
from loc_opt.parallel.goodput import simulate as simulate_goodput
