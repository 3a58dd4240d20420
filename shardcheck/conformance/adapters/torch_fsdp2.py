"""torch FSDP2 (`torch.distributed.fsdp.fully_shard`) behind the adapter protocol.

Strategies: FULL_SHARD / SHARD_GRAD_OP are `reshard_after_forward` True / False on a 1-D mesh;
HYBRID_SHARD is the (replicate, shard) 2-D mesh of the spec; NO_SHARD is `fully_shard` on a
(world, 1) mesh: HSDP with shard groups of one rank is DDP semantics (replicated parameters,
all-reduced gradients) while parameters stay DTensors, so full_params, clip_grad_norm_, the grad
scaler and mixed strategies work as for the sharded cases (`_composable.replicate` is a separate
DDP-based code path that does not compose with `fully_shard` units or DTensor clipping).
`ShardSpec.gradient_divide_factor` is `set_gradient_divide_factor` on every `fully_shard`ed module; a unit
of `ShardSpec.unit_meshes` is `fully_shard`ed on its own 2-D mesh (HSDP), as torchtitan shards experts.
The accumulation knobs are the root's `set_requires_gradient_sync` (no_sync), `set_reshard_after_backward`
and `set_is_last_backward`, set before each micro-batch as torch's test_fully_shard_training does.
"""

from __future__ import annotations

import contextlib

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from shardcheck.strategy import Strategy
from shardcheck.conformance.adapters import dcp
from shardcheck.conformance.adapters.dtensors import full_tensors
from shardcheck.conformance.protocol import ShardSpec, TorchStyleAdapter, Unsupported


def _full(t: torch.Tensor) -> torch.Tensor:
    """A copy of the full value (never a view of live parameters or gradients)."""
    return t.full_tensor() if isinstance(t, DTensor) else t.detach().clone()


# NO_SHARD meshes made in this process, by the data-parallel mesh they replicate over. Module state,
# not the adapter's: a mesh holds its groups and a tensor, which pickling the adapter to a rank
# process would send through shared memory (file descriptors the harness's leak check fails).
_NO_SHARD_MESHES: dict[int, tuple[DeviceMesh, DeviceMesh]] = {}


def strategy_mesh(mesh: DeviceMesh, strategy: str) -> DeviceMesh:
    """The mesh `fully_shard` takes for `strategy` over the data-parallel `mesh`: the mesh itself for
    FULL_SHARD / SHARD_GRAD_OP, the 2-D (replicate, shard) mesh for HYBRID_SHARD, and for NO_SHARD the
    (world, 1) mesh: shard groups of one rank, replicas across (DDP semantics)."""
    if strategy == Strategy.HYBRID_SHARD:
        if mesh.ndim != 2:
            raise ValueError("HYBRID_SHARD needs a 2-D (replicate, shard) mesh")
        return mesh
    if strategy == Strategy.NO_SHARD:
        if id(mesh) not in _NO_SHARD_MESHES:  # the data-parallel mesh is kept alive with it: ids stay unique
            _NO_SHARD_MESHES[id(mesh)] = (mesh, DeviceMesh(mesh.device_type, mesh.mesh.reshape(-1, 1),
                                                            mesh_dim_names=("replicate", "shard")))
        return _NO_SHARD_MESHES[id(mesh)][1]
    return mesh


class TorchFSDP2Adapter(dcp.DCPCheckpoints, TorchStyleAdapter):
    name = "torch-fsdp2"
    version = torch.__version__
    capabilities = TorchStyleAdapter.implied({
        "full_shard", "shard_grad_op", "no_shard", "hybrid_shard", "mixed_strategy", "nested_units", "orig_params",
        "mixed_precision", "per_unit_mixed_precision", "cpu_offload", "clip_grad_norm", "sharded_grad_scaler",
        "all_gather_extensions", "meta_init", "tensor_parallel", "dtensor_tensor_parallel", "dtensor_grads", "checkpoint", "checkpoint_reshard",
        "grad_accumulation", "no_sync", "eval_forward", "unused_params", "requires_grad_changes", "activation_checkpointing", "buffers", "compile",
        "gradient_divide_factor", "token_weighted_loss", "reshard_after_backward", "is_last_backward", "meta_load",
        "idle_experts", "expert_mesh",
    })

    def _mesh(self, spec: ShardSpec, strategy: str):
        mesh = spec.dp_mesh if spec.mesh is not None else init_device_mesh(spec.device.type, (torch.distributed.get_world_size(),))
        return strategy_mesh(mesh, strategy)

    def shard(self, model, spec: ShardSpec):
        def policy(path):
            mp = spec.mixed_precision_of(path)
            if mp is not None and (mp.keep_low_precision_grads or mp.buffer_dtype is not None):
                raise Unsupported("FSDP2 MixedPrecisionPolicy has no buffer_dtype / keep_low_precision_grads")
            return MixedPrecisionPolicy(param_dtype=mp.param_dtype, reduce_dtype=mp.reduce_dtype) if mp else MixedPrecisionPolicy()

        offload = CPUOffloadPolicy(pin_memory=spec.device.type == "cuda") if spec.offload else None
        if spec.tensor_parallel:  # torch's TP styles over the "tp" dimension, then FSDP over "dp"
            parallelize_module(model, spec.mesh["tp"], {path: {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}[
                style]() for path, style in spec.tensor_parallel.items()})

        def one(module, path):
            strategy, kwargs = spec.strategy_of(path), dict(offload_policy=offload) if offload else {}
            mesh = spec.unit_meshes[path] if path in spec.unit_meshes else self._mesh(spec, strategy)  # HSDP on its own
            fully_shard(module, mesh=mesh, mp_policy=policy(path),
                        reshard_after_forward=strategy in (Strategy.FULL_SHARD, Strategy.HYBRID_SHARD), **kwargs)
            if spec.gradient_divide_factor is not None:  # per fully_shard'ed module, as torch documents it
                module.set_gradient_divide_factor(spec.gradient_divide_factor)

        for path, module in spec.unit_modules(model):
            one(module, path)
        one(model, "")
        return model

    def prepare(self, model, spec: ShardSpec, recipe):
        """Shard; with experts some ranks route no token to (`recipe.routed`), FSDP2's
        `set_reduce_scatter_unused_params(True)` on every fully_shard'ed module, as its documentation
        prescribes for a mixture of experts (else ranks reduce-scatter different parameters)."""
        self.shard(model, spec)
        if recipe.routed:
            if not hasattr(model, "set_reduce_scatter_unused_params"):
                raise Unsupported(f"torch {torch.__version__}: FSDP2 has no set_reduce_scatter_unused_params")
            model.set_reduce_scatter_unused_params(True)
        return model

    def shard_from_rank0(self, model, spec: ShardSpec):
        """As torch documents loading a model built on meta into FSDP2: `fully_shard`, `to_empty`, and
        rank 0's full state dict broadcast by `set_model_state_dict(full_state_dict=True,
        broadcast_from_rank0=True)`. The non-persistent buffers are in no state dict: rank 0's are
        broadcast after it (Accelerate's FSDP2 loading re-registers them the same way)."""
        return dcp.load_from_rank0(model, spec.device, lambda m: self.shard(m, spec))

    def held_grads(self, model):
        """Without gradient sync each parameter keeps the unsharded sum (`unsharded_accumulated_grad`,
        else the unsharded parameter's gradient)."""
        out = []
        for module in model.modules():
            group = module._get_fsdp_state()._fsdp_param_group if isinstance(module, FSDPModule) else None
            for fsdp_param in group.fsdp_params if group is not None else ():
                held = fsdp_param.unsharded_accumulated_grad
                if held is None and hasattr(fsdp_param, "_unsharded_param"):
                    held = fsdp_param._unsharded_param.grad
                if held is not None:
                    out.append(held)
        return out

    @contextlib.contextmanager
    def no_sync(self, model):
        """As FSDP2's users write it: `set_requires_gradient_sync(False)` before a micro-batch that
        must not reduce, True again before the last."""
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)

    def set_reshard_after_backward(self, model, flag):
        model.set_reshard_after_backward(flag)  # recurse=True: every fully_shard'ed module

    def set_is_last_backward(self, model, flag):
        model.set_is_last_backward(flag)

    def full_params(self, model):
        return full_tensors({n: p.detach() for n, p in model.named_parameters()})

    def full_grads(self, model):
        return full_tensors({n: p.grad for n, p in model.named_parameters()})

    def clip_grad_norm_(self, model, max_norm, norm_type):
        return _full(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, norm_type))

    def clip_grad_norm_unit_(self, model, path, max_norm):
        raise Unsupported("FSDP2 has no per-unit clip_grad_norm_ method to refuse a non-root call")

    def grad_scaler(self, **kwargs):
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        return ShardedGradScaler(**kwargs)

    def register_comm_hook(self, model, state, hook, path=""):
        raise Unsupported("FSDP2 has no FSDP1-style register_comm_hook")

    def comm_hooks(self, model):
        raise Unsupported("FSDP2 has no FSDP1-style comm hooks")

    def compression_hook(self, dtype):
        raise Unsupported("FSDP2 has no gradient compression hooks (use MixedPrecisionPolicy.reduce_dtype)")

    def local_shards(self, model):
        # `p.to_local()` returns a fresh view each call (gh-166156): patching it would be lost.
        return {n: p._local_tensor for n, p in model.named_parameters()}
