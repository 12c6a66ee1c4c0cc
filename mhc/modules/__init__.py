"""The modules users build: hyper-connection sites, the lane mixer, stream helpers and the
stability metric. :mod:`mhc.mixing` is their public home."""

from mhc.modules.gain import GainReport, amax_gain, collect_h_res
from mhc.modules.hyper_connection import HyperConnection
from mhc.modules.lanes import LaneMixer
from mhc.modules.site import Site
from mhc.modules.streams import StreamCollapse, StreamExpand, expand_streams, reduce_streams, stream_collapse

__all__ = [
    "HyperConnection",
    "LaneMixer",
    "Site",
    "StreamCollapse",
    "StreamExpand",
    "expand_streams",
    "reduce_streams",
    "stream_collapse",
    "GainReport",
    "amax_gain",
    "collect_h_res",
]
