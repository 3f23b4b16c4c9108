"""Patches for ops along a sharded class (vocabulary) dim: softmax, log-softmax, gather of token
ids, top-k, argmax and ``nll_loss`` of TP vocab-sharded logits, computed on each rank's shard
with ``[batch, seq]``-sized reductions instead of an all-gather of ``[batch, seq, vocab]``."""
