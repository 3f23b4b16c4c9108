"""Patches where DTensors meet the rest of a training program: plain tensors given to
DTensor parameters (a full state dict loaded into a sharded model), local tensors turned into
DTensors (``DTensor.from_local`` on shards of different lengths)."""
