"""L2: a model's forward pass per row, batched against solo (``run``)."""
