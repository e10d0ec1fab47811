"""Sharded, atomic checkpoints that reshard to any world size."""
