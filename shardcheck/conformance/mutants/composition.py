"""Mutants of the compositions (family composition): activation checkpointing, meta-device init and
buffers, each modelled on a bug of a real engine (FINDINGS F46-F50, verl#7834, torchtune#218).

Each names `cells`: globs over the cells of its checks at world size 2 that must fail, every other
cell of them must pass (tests/conformance/test_mutants.py::test_mutant_kills_exactly_its_cells).
"""

from __future__ import annotations

import importlib

import torch

from shardcheck.conformance.mutants.base import MutantAdapter, before_shard, replace, untie_shared

AC = "test_composition.py::test_activation_checkpointing"
META = "test_composition.py::test_meta_init"
BUFFERS = "test_composition.py::test_buffers"
COMPILE = "test_composition.py::test_compile"
TENSOR_PARALLEL = "test_composition.py::test_tensor_parallel"


def _module(name: str):
    return importlib.import_module(f"shardcheck.reference_impl.{name}")


class RecomputeRegathers(MutantAdapter):
    """The forward that activation checkpointing recomputes in backward all-gathers its unit again
    although the unit is still gathered (SHARD_GRAD_OP keeps it from forward to backward): one more
    all-gather per checkpointed unit per step, as eager SimpleFSDP does (F49). Numbers unchanged."""

    name = "mutant-ac-recompute-regathers"
    bug = "a recomputed forward re-gathers a unit that is still gathered (SHARD_GRAD_OP + checkpointing)"
    checks = (AC,)
    cells = ("test_activation_checkpointing[*-SHARD_GRAD_OP-*]",)

    def patch(self) -> None:
        replace(_module("sharding"), "in_backward", lambda: False)


class SavesPastCheckpointing(MutantAdapter):
    """FULL_SHARD's saved-tensors hooks installed under activation checkpointing's own: a unit's
    forward saves its activations for backward as it would without checkpointing (the innermost
    hooks win), so checkpointing saves nothing. Numbers and traffic unchanged; forward leaves as much
    held as without checkpointing (what shardcheck's reference did before the family existed)."""

    name = "mutant-ac-saves-past-checkpointing"
    bug = "a unit's saved-tensors hooks override checkpointing's: activations kept, nothing saved by it"
    checks = (AC,)
    cells = ("test_activation_checkpointing[*-FULL_SHARD-*]",)

    def patch(self) -> None:
        replace(_module("sharding"), "innermost_saved_tensors_pack", lambda: None)


class RecomputeSkipsRegather(MutantAdapter):
    """A recomputed forward that runs without the unit's forward hooks finds the shards on the modules:
    the engine puts the full parameters back for backward only through its forward hooks or its
    saved-tensors unpack, and transformers 5 checkpoints a decoder layer's `forward`, not its
    `__call__` (GradientCheckpointingLayer), so neither runs (the reference before recompute.py). The
    recompute fails on every rank (a shard's rows against the hidden size), on the zoo's decoders under
    `activation_checkpointing_enable()` alone: checkpoint_wrapper and the family's own ways recompute
    through `__call__`, and resnet has no transformers checkpointing."""

    name = "mutant-recompute-skips-regather"
    bug = "a recompute that bypasses the unit's hooks (checkpointed forward, not __call__) reads the shards"
    checks = ("test_models_composed.py::test_model_activation_checkpointing",)
    cells = ("test_model_activation_checkpointing[*-transformers]",)
    needs_zoo = True

    def patch(self) -> None:
        def before_backward(unit, output):
            unit.packed = False

        replace(_module("recompute"), "before_backward", before_backward)


class MetaInitUnties(MutantAdapter):
    """Sharding a model built on the meta device gives each module that holds a shared parameter a
    Parameter of its own (FSDP1 materializes module by module with `to_empty(recurse=False)`: F47;
    verl#7834): a tied output projection is initialised and trained apart. Models built on the CPU
    stay tied."""

    name = "mutant-meta-init-unties"
    bug = "a weight two modules share, untied when the model is built on meta"
    checks = (META, META + "_hybrid")
    cells = ("test_meta_init[*]", "test_meta_init_hybrid[*]")
    world_sizes = (2, 4)

    def patch(self) -> None:
        before_shard(lambda module: untie_shared(
            module, lambda p: torch.nn.Parameter(torch.empty_like(p), p.requires_grad) if p.is_meta else None))


class BufferLeftUninitialized(MutantAdapter):
    """Meta-device init runs `reset_parameters()` only on modules that own parameters: a module
    whose only state is a non-persistent buffer (RoPE's inverse frequencies) keeps what `to_empty`
    left (torchtune#218). The first loss differs."""

    name = "mutant-meta-init-buffer-uninitialized"
    bug = "a non-persistent buffer left as to_empty() left it (its module owns no parameter)"
    checks = (META,)
    cells = ("test_meta_init[*]",)

    def patch(self) -> None:
        from shardcheck.conformance.protocol import torch_style

        @torch.no_grad()
        def materialize(model, device):
            model.to_empty(device=device)
            for t in (*model.parameters(), *model.buffers()):
                t.zero_()
            for module in model.modules():
                if hasattr(module, "reset_parameters") and next(module.parameters(recurse=False), None) is not None:
                    module.reset_parameters()
            return model

        replace(torch_style, "materialize", materialize)


class BuffersNotBroadcast(MutantAdapter):
    """Buffers never broadcast (FSDP's way, F48): each rank's BatchNorm statistics follow its own
    batches, and the ranks evaluate with different ones."""

    name = "mutant-buffers-not-broadcast"
    bug = "buffers not broadcast from rank 0 before forward (BatchNorm statistics diverge per rank)"
    checks = (BUFFERS,)
    cells = ("test_buffers[*]",)

    def patch(self) -> None:
        replace(_module("buffers"), "broadcast_", lambda module, group: None)


class CompileDropped(MutantAdapter):
    """Sharding drops what `module.compile()` set: the compiled layers run eagerly, silently (FSDP1
    with flat parameters, F51). Numbers unchanged."""

    name = "mutant-compile-dropped"
    bug = "a layer's torch.compile silently dropped when it is sharded (eager fallback)"
    checks = (COMPILE,)
    cells = ("test_compile[*]",)

    def patch(self) -> None:
        def eager(module):
            for m in module.modules():
                m._compiled_call_impl = None

        before_shard(eager)


class CompileFragmentsOnly(MutantAdapter):
    """F51's shape on a real layer: the compiled layer's own frame falls back to eager, and so does
    every module that holds weights (what dynamo refuses under FSDP1's flat parameters); dynamo still
    compiles the weightless helpers the layer calls (norms, rotary embeddings, activations), so the
    compiler IS handed graphs. Numbers unchanged."""

    name = "mutant-compile-fragments-only"
    bug = "a compiled layer runs eagerly but for the weightless helpers it calls (FSDP1's flat parameters, F51)"
    checks = ("test_models_composed.py::test_model_compile",)
    cells = ("test_model_compile[*]",)
    needs_zoo = True

    def patch(self) -> None:
        def fragments(module):
            for m in module.modules():
                if m._compiled_call_impl is not None:
                    m.forward = torch._dynamo.disable(m.forward, recursive=False)  # its callees still traced
                elif any(True for _ in m.parameters(recurse=False)):
                    m.forward = torch._dynamo.disable(m.forward)

        before_shard(fragments)


class TPNormPerRank(MutantAdapter):
    """Under tensor parallelism the norm adds every TP rank's copy of a replicated parameter's
    gradient (the embedding, the norms, a row-parallel bias): counted T times, the total norm too
    large and the clip too strong (the class of torchtitan#2318, a norm off by 8x)."""

    name = "mutant-tp-norm-counts-replicas"
    bug = "TP-replicated gradients counted once per TP rank in the norm"
    checks = (TENSOR_PARALLEL,)
    cells = ("test_tensor_parallel[*-norm2]",)
    world_sizes = (4,)

    def patch(self) -> None:
        tp = _module("tensor_parallel")
        original = tp.split_counted

        def every_rank_counts(module_params):
            sliced, replicated, group = original(module_params)
            return sliced + replicated, [], group  # as if sliced: summed over the TP group

        replace(tp, "split_counted", every_rank_counts)


class TPInputGradNotReduced(MutantAdapter):
    """A column-parallel linear's input gradient is not summed over the TP group in backward: each
    rank keeps its own part, so everything before the first TP layer (the embedding) trains on a
    fraction of its gradient, different on every TP rank."""

    name = "mutant-tp-input-grad-not-reduced"
    bug = "a column-parallel input's gradient not all-reduced over the TP group"
    checks = (TENSOR_PARALLEL,)
    cells = ("test_tensor_parallel[*]",)
    world_sizes = (4,)

    def patch(self) -> None:
        tp = _module("tensor_parallel")
        replace(tp.CopyToParallel, "backward", staticmethod(lambda ctx, grad: (grad, None)))
