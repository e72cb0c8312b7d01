"""Gradient / pseudo-gradient compression: codecs, compressors, collectives.

* :mod:`~loc_opt.compression.codecs`: stateless wire formats over flat
  arrays (:class:`Codec`).
* :mod:`~loc_opt.compression.compressor`: stateful means over the worker axis
  (:class:`Compressor`).
* :mod:`~loc_opt.compression.feedback`: error feedback (EF, EF21, EControl).
* :mod:`~loc_opt.compression.all_reduce`: :func:`build_compressor`,
  :func:`compressed_mean` and the gradient transformation
  :func:`compressed_all_reduce`.
* :mod:`~loc_opt.compression.comm`: collectives that spread payloads over a
  worker's devices so each element crosses workers once;
  :mod:`~loc_opt.compression.group_comm` (:class:`GroupComm`): the same
  collectives over groups of workers, so any compressor averages inside
  groups (hierarchical DiLoCo's group level).
* Codecs: :mod:`~loc_opt.compression.quant` (int8/int4/fp8/fp4/2-bit),
  :mod:`~loc_opt.compression.sparse` (top-k, random-k),
  :mod:`~loc_opt.compression.dct` (chunked DCT for DeMo/SparseLoCo).
* Row-wise quantizers (MuLoCo): :func:`statistical` (centroid tables) and
  :func:`row_linear` (:mod:`~loc_opt.compression.statistical`).
* Compressors: :func:`powersgd` (:mod:`~loc_opt.compression.powersgd`),
  :func:`terngrad` (:mod:`~loc_opt.compression.terngrad`), :func:`dgc`
  (:mod:`~loc_opt.compression.dgc`),
  :mod:`~loc_opt.compression.lgreco` (layer-wise levels).
* :mod:`~loc_opt.compression.registry`: everything by name;
  :func:`as_compressor`, through which every function that takes a codec
  accepts a name (``codec='int8'``) or ``(name, kwargs)``.

Inside the package, modules import only from the layers below their own:
the wire formats (``codecs``, ``comm``, ``group_comm``, ``packing``,
``quant``, ``sparse``, ``dct``); ``compressor``; ``feedback`` and the
compressors (``dgc``, ``powersgd``, ``terngrad``, ``statistical``,
``lgreco``); ``all_reduce`` and ``registry``.
``loc_opt.parallel`` may import this package, never the reverse.
"""

from loc_opt.compression.all_reduce import build_compressor
from loc_opt.compression.all_reduce import compressed_mean
from loc_opt.compression.all_reduce import compressed_all_reduce
from loc_opt.compression.all_reduce import CompressedAllReduceState
from loc_opt.compression.codecs import Codec
from loc_opt.compression.codecs import identity
from loc_opt.compression.comm import Comm
from loc_opt.compression.comm import pad_to
from loc_opt.compression.group_comm import group_shifts
from loc_opt.compression.group_comm import GroupComm
from loc_opt.compression.compressor import all_of
from loc_opt.compression.compressor import Compressor
from loc_opt.compression.compressor import from_codec
from loc_opt.compression.compressor import leafwise
from loc_opt.compression.compressor import matrices
from loc_opt.compression.compressor import min_size
from loc_opt.compression.compressor import partition
from loc_opt.compression.compressor import skip_paths
from loc_opt.compression.feedback import ef21
from loc_opt.compression.feedback import econtrol
from loc_opt.compression.feedback import error_feedback
from loc_opt.compression.feedback import FEEDBACK
from loc_opt.compression.feedback import with_feedback
from loc_opt.compression.dgc import dgc
from loc_opt.compression.dgc import dgc_warmup_ratio
from loc_opt.compression.lgreco import lgreco_errors
from loc_opt.compression.lgreco import lgreco_plan
from loc_opt.compression.lgreco import lgreco_replan
from loc_opt.compression.lgreco import per_leaf
from loc_opt.compression.powersgd import powersgd
from loc_opt.compression.quant import fp4_codec
from loc_opt.compression.quant import fp8_codec
from loc_opt.compression.quant import int4_codec
from loc_opt.compression.quant import int8_codec
from loc_opt.compression.quant import int8_codec as int8
from loc_opt.compression.quant import two_bit_codec
from loc_opt.compression.registry import as_compressor
from loc_opt.compression.registry import CODECS
from loc_opt.compression.registry import COMPRESSORS
from loc_opt.compression.registry import make_codec
from loc_opt.compression.registry import make_compressor
from loc_opt.compression.registry import Scheme
from loc_opt.compression.sparse import randomk_codec
from loc_opt.compression.statistical import row_linear
from loc_opt.compression.statistical import statistical
from loc_opt.compression.sparse import topk_codec
from loc_opt.compression.terngrad import terngrad
