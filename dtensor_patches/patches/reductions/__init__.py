"""Patches for reductions, scans and order statistics along dims, and reads of a pending reduction."""
