"""Patches for advanced indexing, indexed writes and ops with data-dependent output shapes."""
