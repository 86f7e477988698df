"""Eviction strategies: which stored tokens to drop."""

from kvlib.policies.eviction.keydiff import KeyDiff
from kvlib.policies.eviction.knorm import KNorm
from kvlib.policies.eviction.random import Random
from kvlib.policies.eviction.streaming_llm import StreamingLLM
from kvlib.policies.eviction.tova import TOVA

__all__ = ["KNorm", "KeyDiff", "Random", "StreamingLLM", "TOVA"]
