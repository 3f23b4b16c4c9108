"""Patches for attention, convolutions and matrix-vector products."""
