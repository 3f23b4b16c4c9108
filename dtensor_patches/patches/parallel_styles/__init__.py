"""Patches for tensor-parallel plans (parallelize_module and its styles)."""
