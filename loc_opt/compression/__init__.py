"""Gradient / pseudo-gradient compression: codecs and compressed means."""

from loc_opt.compression.codecs import Codec
from loc_opt.compression.codecs import CODECS
from loc_opt.compression.codecs import identity
from loc_opt.compression.codecs import int8
from loc_opt.compression.codecs import make_codec
from loc_opt.compression.collectives import compressed_mean
from loc_opt.compression.collectives import mean_flat
from loc_opt.compression.collectives import pad_to
