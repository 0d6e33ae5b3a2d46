"""L1: the cache alone, byte for byte. ``run`` (``run_l1``) drives a
schedule's member calls on the batch and on the rows alone in mlx-lm's
caches; ``calls`` checks each member call as it returns, ``checks`` each
event's state, ``solo`` keeps the rows alone; ``vectors`` writes and checks
the conformance vectors other languages' runners read."""
