"""Patches for elementwise ops and activations, and pending reductions through them."""
