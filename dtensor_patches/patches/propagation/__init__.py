"""Patches to how torch decides placements at all, whatever the op: the same decision on every
rank (placements that hash alike in every process)."""
