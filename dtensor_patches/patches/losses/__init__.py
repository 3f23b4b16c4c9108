"""Patches for losses reduced over shards, and for loss_parallel()."""
