"""`shardcheck simulate`: check sharding at world sizes far beyond the machine, in one process.

Rank ``r`` of ``N`` is played by initialising torch's fake process group (collectives return at
once, data is meaningless) with that rank; the model is built on the meta device.  Checked: the
shard shape and padding of every parameter (``torch.chunk`` dim-0 semantics), the bytes each rank
holds (at most ``ceil(n / N)`` rows per parameter), and the collectives of one training step by
kind, count and bytes against the implementation's design formula.  No numerics.
"""
from .runner import default_ranks, human_summary, simulate, simulate_rank

__all__ = ["simulate", "simulate_rank", "default_ranks", "human_summary"]
