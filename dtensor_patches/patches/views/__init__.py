"""Patches for views and shape ops: slices, selects, squeezes, stacks, flips, unfolds, as_strided."""
