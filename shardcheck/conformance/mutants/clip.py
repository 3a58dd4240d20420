"""Mutants of ``clip_grad_norm_`` (shardcheck/reference_impl/clip.py)."""

from __future__ import annotations

import importlib

import torch.distributed as dist

from shardcheck.conformance.mutants.base import MutantAdapter, Proxy, accepting_non_root, replace


def _modules():
    return importlib.import_module("shardcheck.reference_impl"), importlib.import_module("shardcheck.reference_impl.clip")


class ClipLocalNorm(MutantAdapter):
    """Gradient norm computed from the local shard only: the all-reduce of the per-rank
    ``sum |g|^p`` (or max) is missing, so each rank clips with its own, smaller, norm and the ranks
    disagree (the classic bug of calling ``torch.nn.utils.clip_grad_norm_`` on sharded parameters,
    which FSDP1's own ``clip_grad_norm_`` exists to avoid)."""

    name = "mutant-clip-local-norm"
    bug = "clip norm from the local shard only (no all-reduce)"
    checks = ("test_clip_grad_dtensor.py::test_clip_grad_norm_1d", "test_train_parity.py::test_train_parity")

    def patch(self) -> None:
        _, clip = _modules()
        replace(clip, "dist", Proxy(dist, all_reduce=lambda tensor, *args, **kwargs: None))


class ClipReplicatedOvercount(MutantAdapter):
    """Replicated (NO_SHARD) gradients counted once per rank in the norm: every rank adds
    ``|g|^p`` of its full replica, so with ``W`` ranks the total is ``W^(1/p)`` times too large
    (FSDP1's NO_SHARD handles, whose flat parameters are not sharded, must be counted once)."""

    name = "mutant-clip-replicated-overcount"
    bug = "NO_SHARD/replicated gradients counted once per rank in the norm"
    checks = ("test_clip_grad.py::test_ddp_parity",)

    def patch(self) -> None:
        from shardcheck.reference_impl.sharding import Unit

        replace(Unit, "first_replica", property(lambda self: True))


class ClipInfSummed(MutantAdapter):
    """inf-norm reduced with SUM instead of MAX across ranks: the total is the sum of the per-rank
    maxima (the p < inf reduction path reused for p = inf)."""

    name = "mutant-clip-inf-summed"
    bug = "inf-norm all-reduced with SUM (sum of per-rank maxima) instead of MAX"
    checks = ("test_clip_grad_dtensor.py::test_clip_grad_norm_1d",)

    def patch(self) -> None:
        _, clip = _modules()

        def all_reduce(tensor, op=None, group=None, async_op=False):
            return dist.all_reduce(tensor, group=group, async_op=async_op)  # op dropped: always SUM

        replace(clip, "dist", Proxy(dist, all_reduce=all_reduce))


class ClipUnclamped(MutantAdapter):
    """Clip coefficient ``max_norm / total`` not clamped to 1: gradients whose total norm is below
    ``max_norm`` are scaled UP to norm ``max_norm`` instead of being left alone."""

    name = "mutant-clip-unclamped"
    bug = "clip coefficient not clamped to 1 (small gradients scaled up)"
    checks = ("test_clip_grad.py::test_below_max_norm_leaves_grads_unchanged",)

    def patch(self) -> None:
        import torch

        _, clip = _modules()
        replace(clip, "torch", Proxy(torch, clamp=lambda input, min=None, max=None: input))


class ClipNonRootAccepted(MutantAdapter):
    """``clip_grad_norm_`` on a non-root unit is not rejected: it silently clips only that unit's
    subtree with that subtree's norm (FSDP1 requires the root, since only it sees every gradient)."""

    name = "mutant-clip-non-root-accepted"
    bug = "clip_grad_norm_ on a non-root unit not rejected"
    checks = ("test_clip_grad.py::test_non_root",)

    def patch(self) -> None:
        ri, clip = _modules()
        clip_grad_norm_ = accepting_non_root(clip.clip_grad_norm_)
        replace(clip, "clip_grad_norm_", clip_grad_norm_)
        replace(ri, "clip_grad_norm_", clip_grad_norm_)


class ClipNoGradsSilent(MutantAdapter):
    """A rank with no gradients clips silently: no warning that the total norm comes back in the
    default dtype."""

    name = "mutant-clip-no-grads-silent"
    bug = "clip_grad_norm_ on a rank without gradients does not warn"
    checks = ("test_clip_grad.py::test_no_gradients",)

    def patch(self) -> None:
        import warnings

        _, clip = _modules()
        replace(clip, "warnings", Proxy(warnings, warn=lambda *args, **kwargs: None))
