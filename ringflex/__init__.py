"""ringflex: context-parallel (ring) attention with flex_attention-style mods at global positions."""
from . import mods, training
from .api import ring_flex_attention
from .module import RingFlexAttention, RingFlexMode
from .parallel.fault import CallRejected, RingFailure
from .parallel.shard import shard, unshard
from .plan.layout import LAYOUTS, Sharding
from .plan.sharding import shard_by_mask
from .varlen import PackedSequences, varlen_attention

__all__ = ["ring_flex_attention", "shard", "unshard", "mods", "LAYOUTS", "Sharding", "shard_by_mask",
           "RingFlexAttention", "RingFlexMode",
           "PackedSequences", "varlen_attention", "training", "CallRejected", "RingFailure"]
__version__ = "0.1.0"
