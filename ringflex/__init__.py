"""ringflex: context-parallel (ring) attention with flex_attention-style mods at global positions."""
from . import mods
from .api import ring_flex_attention
from .parallel.layout import LAYOUTS
from .parallel.shard import shard, unshard

__all__ = ["ring_flex_attention", "shard", "unshard", "mods", "LAYOUTS"]
__version__ = "0.1.0"
