"""How each implementation is sharded, inspected and stepped inside a fake world.

Every simulator shards through the implementation's adapter, from the same registry as
`shardcheck run` (each transformer block as a unit, then the root; FULL_SHARD over the whole world,
or HYBRID_SHARD on a 2-D (replicate, shard) mesh),
reads back what *the implementation* decided per parameter (local shape, padded
rows, bytes of storage held), runs one forward + backward under the collective counter as far as
the implementation allows on this device, and says how far that was (``coverage``).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from shardcheck.strategy import Strategy
from shardcheck.conformance import adapters
from shardcheck.conformance.protocol import ShardSpec

from . import expected as E
from .options import LAYOUT_CHECKED
from shardcheck.conformance.measure.traffic import CollectiveCounter


def _shard(name: str, model: nn.Module, device_type: str, mesh: E.Mesh) -> nn.Module:
    """FULL_SHARD (1-D) or HYBRID_SHARD (2-D mesh) of every block and the root, by the named
    implementation's adapter."""
    from torch.distributed.device_mesh import init_device_mesh

    if mesh.world_size != dist.get_world_size():
        raise ValueError(f"mesh {mesh.shape} does not span the world of {dist.get_world_size()}")
    units = tuple(f"blocks.{i}" for i in range(len(model.blocks)))
    if mesh.two_d:
        device_mesh = init_device_mesh(device_type, tuple(mesh.shape), mesh_dim_names=("replicate", "shard"))
    else:
        device_mesh = init_device_mesh(device_type, (dist.get_world_size(),))
    strategy = Strategy.HYBRID_SHARD if mesh.two_d else Strategy.FULL_SHARD
    return adapters.load(name).shard(model, ShardSpec(strategy=strategy, units=units, mesh=device_mesh))


def _storage_bytes(t: torch.Tensor) -> int:
    return t.untyped_storage().nbytes()


def _row(name: str, local: torch.Tensor, padded_rows: int, storage_bytes: int) -> dict:
    return {"name": name, "local_shape": list(local.shape), "padded_rows": padded_rows,
            "bytes": local.numel() * local.element_size(), "storage_bytes": storage_bytes}


class ReferenceSim:
    name = "reference"
    coverage = ("sharding at init (meta); collectives of one forward + backward on meta tensors. "
                "Not simulated: the FULL_SHARD re-gather in backward (its saved-tensors hooks key on "
                "storage addresses, which meta tensors lack), so all-gathers count once per unit")
    gathers_per_unit = 1

    def shard(self, model: nn.Module, mesh: E.Mesh) -> nn.Module:
        import shardcheck.reference_impl as ri

        model = _shard(self.name, model, "cpu", mesh)
        for unit in ri.units(model):
            unit.device = torch.device("meta")  # all-gather into meta buffers, not onto the CPU
        return model

    def rows(self, model: nn.Module) -> list[dict]:
        import shardcheck.reference_impl as ri

        slot_of = {id(sp.shard): sp.slot for u in ri.units(model) for sp in u.params}
        out = []
        for name, p in model.named_parameters():
            rows = p.shape[0] if p.dim() else 1
            out.append(_row(name, p, slot_of[id(p)].chunk - rows, _storage_bytes(p)))
        return out

    def step(self, model: nn.Module) -> CollectiveCounter:
        with CollectiveCounter() as counter:
            model(model.example_input("meta")).float().sum().backward()
        return counter

    def expected(self, units: list[list[dict]], mesh: E.Mesh, rank: int) -> dict:
        """Per unit with parameters: all-gather and reduce-scatter of ``S * S_u`` bytes in the shard
        group; on a 2-D mesh also one all-reduce of ``S_u`` bytes in the replicate group."""
        return E.step_collectives(units, mesh, rank, self.gathers_per_unit)


def meta_buffer_comms():
    """FSDP2's default all-gather and reduce-scatter (torch's own classes, through its public
    ``set_custom_all_gather`` / ``set_custom_reduce_scatter``), with the buffers FSDP2 asks them for
    allocated on meta at the sizes it asks: the all-gather's output (every rank's padded shard, from
    which FSDP2 views the unsharded parameters) and the reduce-scatter's input (the padded unsharded
    gradients). FSDP2's copy-in and copy-out then run their meta kernels; the collectives carry the
    engine's own shapes to the dispatcher, where the fake world answers them and the counter sizes
    them. ``foreach_reduce`` allocates the reduce-scatter's input, then its output (this rank's shard,
    which becomes the sharded parameter's gradient): that output stays on the parameter's device."""
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather, DefaultReduceScatter

    class MetaGather(DefaultAllGather):
        def allocate(self, size, *, dtype, device):
            return torch.empty(*size, dtype=dtype, device="meta")

    class MetaReduceInput(DefaultReduceScatter):
        input_next = True

        def allocate(self, size, *, dtype, device):
            on, self.input_next = ("meta" if self.input_next else device), not self.input_next
            return torch.empty(*size, dtype=dtype, device=on)

        def __call__(self, *args, **kwargs):
            output, input_ = kwargs.get("output_tensor"), kwargs.get("input_tensor")
            if output is None or input_ is None or output.is_meta or not input_.is_meta:
                raise RuntimeError("FSDP2's reduce-scatter did not allocate its input, then its output, "
                                   "as simulate expects (torch.distributed.fsdp changed)")
            return super().__call__(*args, **kwargs)

    return MetaGather(), MetaReduceInput()


class TorchFSDP2Sim:
    name = "torch-fsdp2"
    coverage = ("sharding at init (meta); then to_empty(cpu) materialises only the local shards (FSDP2 "
                "refuses meta parameters in training) and one forward + backward runs through FSDP2's own "
                "all-gathers and reduce-scatters, their padded buffers on meta (gathered parameters, "
                "activations and unsharded gradients too; each rank's gradient shard on the CPU); "
                "FULL_SHARD (and HYBRID_SHARD) reshards every unit after forward, the root too, so each is "
                "gathered twice")

    def shard(self, model: nn.Module, mesh: E.Mesh) -> nn.Module:
        return _shard(self.name, model, "cpu", mesh)

    def rows(self, model: nn.Module) -> list[dict]:
        from torch.distributed.fsdp._fully_shard._fsdp_state import _get_module_fsdp_state

        padded = {}
        for m in model.modules():
            state = _get_module_fsdp_state(m)
            group = state._fsdp_param_group if state else None
            for fp in group.fsdp_params if group else []:
                padded[id(fp.sharded_param)] = fp.padded_sharded_param_size[0]
        out = []
        for name, p in model.named_parameters():
            local = p._local_tensor
            rows = local.shape[0] if local.dim() else 1
            out.append(_row(name, local, padded[id(p)] - rows, _storage_bytes(local)))
        return out

    def step(self, model: nn.Module) -> CollectiveCounter:
        """One forward + backward with every padded gathered and reduce-scattered buffer on meta
        (``meta_buffer_comms``): FSDP2 still sizes, issues and copies into them, only no byte is
        written (at 16,384 ranks a step would copy 35 GiB of padding, docs/sharding.md)."""
        from torch.distributed.fsdp import FSDPModule

        for module in model.modules():
            if isinstance(module, FSDPModule):
                gather, reduce = meta_buffer_comms()
                module.set_custom_all_gather(gather)
                module.set_custom_reduce_scatter(reduce)
        model.to_empty(device="cpu")
        with CollectiveCounter() as counter:
            model(model.example_input("meta")).float().sum().backward()
        return counter

    def expected(self, units: list[list[dict]], mesh: E.Mesh, rank: int) -> dict:
        """Every unit (FULL_SHARD / HYBRID_SHARD: reshard_after_forward=True, root included)
        gathered in forward and again in backward; one reduce-scatter each (and on a 2-D mesh one
        all-reduce across replicas)."""
        return E.step_collectives(units, mesh, rank, 2, empty_units=True)


SIMULATORS = {s.name: s for s in (ReferenceSim, TorchFSDP2Sim)}
assert tuple(SIMULATORS) == LAYOUT_CHECKED, "options.LAYOUT_CHECKED names these simulators for --help"


def simulator(name: str):
    """The simulator of a registered implementation: it shards through the adapter, and knows how
    to read that implementation's per-parameter layout (padding, storage), which no protocol exposes."""
    if name not in adapters.available():
        raise ValueError(f"unknown implementation {name!r}; available: {', '.join(sorted(adapters.available()))}")
    if name not in SIMULATORS:
        raise ValueError(f"no simulator for implementation {name!r} (it must read the implementation's shard "
                         f"layout); simulated: {', '.join(SIMULATORS)}")
    return SIMULATORS[name]()
