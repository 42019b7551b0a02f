"""From store examples to device tensors: which examples a step takes (schedule), how they are grouped into
micro-batches and rows from their lengths alone (plan), and the tensors of one micro-batch (collate)."""
