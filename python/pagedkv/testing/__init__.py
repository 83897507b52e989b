"""Test support: the PyTorch reference of the cache (:mod:`.reference`) and the scenario driver
(:mod:`.scenarios`) shared by the CPU and GPU suites."""

from .reference import EMPTY_LSE, ReferenceCache, ReferenceCacheError, attention, merge_states, rope, split_qkv

__all__ = ["EMPTY_LSE", "ReferenceCache", "ReferenceCacheError", "attention", "merge_states", "rope", "split_qkv"]
