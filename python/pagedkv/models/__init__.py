"""Relax ``nn`` models that use ``pagedkv.relax.PagedKVCache``."""
