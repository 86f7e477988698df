"""Eviction strategies: which stored tokens to drop."""

from kvlib.policies.eviction.streaming_llm import StreamingLLM

__all__ = ["StreamingLLM"]
