"""reference_impl: a small, correct sharded data parallel (FSDP-style) implementation.

What is sharded.  ``shard(module)`` turns a module into a *unit* that owns the parameters of its
subtree not owned by an already-sharded sub-unit (shard blocks first, then the root).  Every owned
parameter of ``n`` rows is split along dim 0 like ``torch.chunk(p, ws)``: rank ``r`` keeps rows
``[r*c, (r+1)*c)`` with ``c = ceil(n / ws)`` (trailing ranks may keep fewer rows, or none).  That
slice *is* the registered ``nn.Parameter``, so ``model.parameters()`` / the optimizer / the grad
scaler / ``clip_grad_norm_`` all work on shards; optimizer state is sharded for free.

When it is gathered.  Before a unit's forward one all-gather gives every rank the full
parameters; after it FULL_SHARD (and HYBRID_SHARD) free them and backward gathers them again;
SHARD_GRAD_OP keeps them until the unit's backward; NO_SHARD never shards (it is DDP).  The whole
life of a unit's parameters reads top to bottom in ``sharding.py``.

What each collective computes.  With ``W`` data-parallel ranks and local gradient ``g_r``:

* all-gather (forward, FULL_SHARD backward): ``full = cat_r(shard_r)`` (padding dropped).
* reduce-scatter (backward): rank ``r`` gets ``(1/W) * sum_q g_q[rows of r]`` -- the average
  gradient of its own rows.  It is computed as ``post(reduce_scatter(pre(g)))`` with
  ``pre(x) = x/f``, ``post(x) = x/(W/f)``, ``f ~ sqrt(W)`` a power of two (torch's ``DefaultState``)
  so float16 sums neither overflow nor underflow.
* NO_SHARD: ``all_reduce`` instead of reduce-scatter, same ``pre``/``post`` averaging.
* HYBRID_SHARD on a ``(replicate, shard)`` mesh: reduce-scatter in the shard group, then
  all-reduce across replicas; ``W`` is the product of both sizes.
* ``clip_grad_norm_``: one all-reduce of the local ``sum |g|^p`` (or max for ``p = inf``), each
  element counted once; ``ShardedGradScaler``: one all-reduce of the local ``found_inf`` flags.

SHARD_OPTIMIZER (ZeRO-1): NO_SHARD units, and ``ShardedOptimizer`` around the torch optimizer: each
rank steps only its rows of every parameter (its ~1/n of the optimizer state), then one all-gather
per dtype makes the parameters whole again (``optimizer.py``).

Gradient accumulation: backwards inside ``no_sync(root)`` keep full gradients on the rank,
summed; the next backward reduces the sum with its own; ``set_reshard_after_backward(root, False)``
keeps the gathered parameters for the next micro-batch's forward (``accumulation.py``).
``set_reduce_unused(root, True)``: a gradient some ranks lack (an expert routed no token there) is
kept wherever some rank has one, None where none has, as DDP's find_unused_parameters (``routed.py``).

Tensor parallelism (``parallelize``, before ``shard``): Megatron's column- and row-parallel linears
over a second group; the units then shard the TP slices over the data-parallel group
(``tensor_parallel.py``).

Mixed precision casts shards to ``param_dtype`` before the all-gather and reduces gradients in
``reduce_dtype``; the sharded parameters stay in their own dtype.  All-gather extensions
(``fsdp_pre_all_gather`` / ``fsdp_post_all_gather``) let a parameter choose what is communicated.
"""
from .accumulation import no_sync, set_reshard_after_backward
from .routed import set_reduce_unused
from .clip import clip_grad_norm_
from .comm_hooks import (
    DefaultState,
    LowPrecisionState,
    allreduce_hook,
    bf16_compress_hook,
    fp16_compress_hook,
    reduce_scatter_hook,
    register_comm_hook,
)
from .full_state import full_grads, full_params, full_state
from .grad_scaler import ShardedGradScaler
from .mixed_precision import MixedPrecision
from .optimizer import ShardedOptimizer
from .sharding import ShardingStrategy, Unit, local_shard, shard, units
from .tensor_parallel import parallelize

__all__ = [
    "shard", "no_sync", "set_reshard_after_backward", "set_reduce_unused", "ShardingStrategy", "MixedPrecision", "Unit", "units", "local_shard",
    "full_params", "full_state", "full_grads", "clip_grad_norm_", "ShardedGradScaler",
    "register_comm_hook", "DefaultState", "LowPrecisionState", "allreduce_hook",
    "reduce_scatter_hook", "fp16_compress_hook", "bf16_compress_hook", "parallelize", "ShardedOptimizer",
]
