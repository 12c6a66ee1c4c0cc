"""Stream mixing, the public home of the layers: ``HyperConnection`` (mHC and plain HC),
``LaneMixer``, the stream helpers and the paper's stability metric (defined in
:mod:`mhc.modules`)."""

from mhc._checks import DEFAULT_RMS_EPS, MAX_STREAMS
from mhc.modules import (
    GainReport,
    HyperConnection,
    LaneMixer,
    StreamCollapse,
    StreamExpand,
    amax_gain,
    collect_h_res,
    expand_streams,
    reduce_streams,
    stream_collapse,
)

__all__ = [
    "HyperConnection",
    "LaneMixer",
    "StreamCollapse",
    "stream_collapse",
    "StreamExpand",
    "expand_streams",
    "reduce_streams",
    "GainReport",
    "amax_gain",
    "collect_h_res",
    "MAX_STREAMS",
    "DEFAULT_RMS_EPS",
]
