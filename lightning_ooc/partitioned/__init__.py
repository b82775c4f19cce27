"""Features partitioned across machines: partitioners, the row exchange over torch.distributed, remote rows."""
