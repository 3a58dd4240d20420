"""`shardcheck simulate`: check sharding at world sizes far beyond the machine, on one machine.

Rank ``r`` of ``N`` is played by a process of its own (``processes``: forked, as many side by side
as there are CPUs and memory) initialising torch's fake process group (collectives return at
once, data is meaningless) with that rank; the model is built on the meta device.  The world is
1-D (FULL_SHARD) or a 2-D ``R x S`` (replicate, shard) mesh (HYBRID_SHARD: split over the ``S``
ranks of a shard group, replicated over ``R``).  Checked: the shard shape and padding of every
parameter (``torch.chunk`` dim-0 semantics over the shard group), the bytes each rank holds (at
most ``ceil(n / S)`` rows per parameter), and the collectives of one training step by kind,
count, bytes and group of ranks against the implementation's design formula.  No numerics.

Only a few ranks are simulated: shard ranks fall into a handful of *classes* that hold alike
(``expected.rank_classes``, from the shapes alone); both ends of every class, in the first and the
last replica, are simulated and the rest of the world is checked by arithmetic
(``verdicts.every_rank_by_class``).
"""
__all__ = ["simulate", "simulate_rank", "default_ranks", "human_summary"]


def __getattr__(name: str):
    """shard_layouts.py's names, imported on first use: `shardcheck --help` must not import torch."""
    if name in __all__:
        from . import shard_layouts

        return getattr(shard_layouts, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
