"""The sharding strategies, named once: the reference implementation, the protocol (`ShardSpec.strategy`,
the capabilities `of_strategy` names) and the reports all use these words.

A `Strategy` is a `str` (`enum.StrEnum`): `Strategy.FULL_SHARD == "FULL_SHARD"`, it is written to JSON
and into cell ids as that string, and an adapter may be handed either.  What crosses to an xdist
controller (`ctx.record`, user properties) is a plain `str(member)`: execnet serializes no enum.  This module imports nothing,
so the torch-free vocabulary of the protocol can import it as well as the reference implementation.

    FULL_SHARD       parameters, gradients and optimizer state sharded; parameters resharded after forward
    SHARD_GRAD_OP    gradients and optimizer state sharded; full parameters kept from forward to backward
    NO_SHARD         replicated (DDP): gradients all-reduced
    HYBRID_SHARD     FULL_SHARD within the shard dimension of a 2-D (replicate, shard) mesh, replicated across
    SHARD_OPTIMIZER  replicated parameters and gradients, the optimizer state sharded (ZeRO-1)
"""

from __future__ import annotations

import enum


class Strategy(enum.StrEnum):
    FULL_SHARD = "FULL_SHARD"
    SHARD_GRAD_OP = "SHARD_GRAD_OP"
    NO_SHARD = "NO_SHARD"
    HYBRID_SHARD = "HYBRID_SHARD"
    SHARD_OPTIMIZER = "SHARD_OPTIMIZER"

    __repr__ = str.__repr__  # 'FULL_SHARD': a ShardSpec, a list of strategies in a message, print as before
