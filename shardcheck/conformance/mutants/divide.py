"""Mutants of the user-set gradient divide factor (ShardSpec.gradient_divide_factor;
shardcheck/reference_impl/collectives.py: divide_factors, average_gradient)."""

from __future__ import annotations

import importlib

from shardcheck.conformance.mutants.base import MutantAdapter, replace


def _collectives():
    return importlib.import_module("shardcheck.reference_impl.collectives")


class FactorReplicasAveraged(MutantAdapter):
    """HYBRID_SHARD with a divide factor d: d divides the reduce-scatter's sum over the shard group, but the
    all-reduce across replicas still averages (an AVG where the factor's sum belongs), so gradients are
    ``sum / (d * replicas)``: the shape of an engine that swaps only the reduce-scatter's op for the
    factor's (FSDP2 pre-multiplies the reduce-scatter by 1/d and must then SUM across replicas;
    pytorch#155903 was this class). Exact on every mesh with one replica, 1-D ones included."""

    name = "mutant-factor-replicas-averaged"
    bug = "HYBRID_SHARD divide factor over the shard group only, replicas still averaged"
    checks = ("test_train_parity_divide.py::test_train_parity_divide_factor_hybrid",)
    world_sizes = (4,)  # the hybrid meshes are world size 4's
    cells = ("test_train_parity_divide_factor_hybrid[ws4-2x2-*]", "test_train_parity_divide_factor_hybrid[ws4-4x1-*]")

    def patch(self) -> None:
        C = _collectives()
        original = C.average_gradient

        def average_gradient(flat, shard_group, replicate_group, factor=None):
            out = original(flat, shard_group, replicate_group, factor)
            replicas = C.group_size(replicate_group)
            return out.div_(replicas) if factor is not None and shard_group is not None and replicas > 1 else out

        replace(C, "average_gradient", average_gradient)


class FactorAfterPredivide(MutantAdapter):
    """The user's divide factor d taken as the post-divide while the pre-divide stays the default one,
    ``f = predivide_factor(world size)``: gradients are ``sum / (f * d)`` (pre/post bookkeeping that
    replaces one half of the split and keeps the other). Exact at world size 1 (f = 1), f times too
    small elsewhere (f = 2 at 2 and 4 ranks)."""

    name = "mutant-factor-after-predivide"
    bug = "divide factor applied after the default pre-divide: sum / (predivide(W) * d)"
    checks = ("test_train_parity_divide.py::test_train_parity_divide_factor",)

    def patch(self) -> None:
        C = _collectives()
        original = C.divide_factors

        def divide_factors(world_size, factor=None):
            return original(world_size) if factor is None else (C.predivide_factor(world_size), float(factor))

        replace(C, "divide_factors", divide_factors)
