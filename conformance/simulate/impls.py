"""How each implementation is sharded, inspected and stepped inside a fake world.

Every simulator shards through the implementation's adapter, from the same registry as
`shardcheck run` (each transformer block as a unit, then the root, FULL_SHARD over the whole world),
reads back what *the implementation* decided per parameter (local shape, padded
rows, bytes of storage held), runs one forward + backward under the collective counter as far as
the implementation allows on this device, and says how far that was (``coverage``).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from conformance import adapters
from conformance.protocol import ShardSpec

from .comms import CollectiveCounter


def _shard(name: str, model: nn.Module, device_type: str) -> nn.Module:
    """FULL_SHARD of every block and the root, by the named implementation's adapter."""
    from torch.distributed.device_mesh import init_device_mesh

    units = tuple(f"blocks.{i}" for i in range(len(model.blocks)))
    mesh = init_device_mesh(device_type, (dist.get_world_size(),))
    return adapters.load(name).shard(model, ShardSpec(strategy="FULL_SHARD", units=units, mesh=mesh))


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

    def shard(self, model: nn.Module) -> nn.Module:
        import reference_impl as ri

        model = _shard(self.name, model, "cpu")
        for unit in ri.units(model):
            unit.device = torch.device("meta")  # all-gather into meta buffers, not onto the CPU
        return model

    def rows(self, model: nn.Module) -> list[dict]:
        import reference_impl as ri

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

    def expected(self, units: list[list[dict]], ws: int) -> dict:
        """All-gather and reduce-scatter once per unit with parameters, of ``ws * S_u`` elements."""
        sizes = [ws * sum(p["chunk"] * p["row_numel"] * p["itemsize"] for p in u) for u in units if u]
        one = {"count": len(sizes), "bytes": sum(sizes)}
        return {"all_gather": {"count": one["count"] * self.gathers_per_unit,
                               "bytes": one["bytes"] * self.gathers_per_unit},
                "reduce_scatter": dict(one)}


class TorchFSDP2Sim:
    name = "torch-fsdp2"
    coverage = ("sharding at init (meta); then to_empty(cpu) materialises only the local shards and "
                "one forward + backward runs on the CPU (FSDP2 refuses meta parameters in training); "
                "FULL_SHARD reshards every unit after forward, the root too, so each is gathered twice")

    def shard(self, model: nn.Module) -> nn.Module:
        return _shard(self.name, model, "cpu")

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
        model.to_empty(device="cpu")
        with CollectiveCounter() as counter:
            model(model.example_input("cpu")).float().sum().backward()
        return counter

    def expected(self, units: list[list[dict]], ws: int) -> dict:
        """Every unit (FULL_SHARD: reshard_after_forward=True, root included) gathered in forward and
        again in backward; one reduce-scatter each."""
        sizes = [ws * sum(p["chunk"] * p["row_numel"] * p["itemsize"] for p in u) for u in units]
        return {"all_gather": {"count": 2 * len(sizes), "bytes": 2 * sum(sizes)},
                "reduce_scatter": {"count": len(sizes), "bytes": sum(sizes)}}


SIMULATORS = {s.name: s for s in (ReferenceSim, TorchFSDP2Sim)}


def simulator(name: str):
    """The simulator of a registered implementation: it shards through the adapter, and knows how
    to read that implementation's per-parameter layout (padding, storage), which no protocol exposes."""
    if name not in adapters.available():
        raise ValueError(f"unknown implementation {name!r}; available: {', '.join(sorted(adapters.available()))}")
    if name not in SIMULATORS:
        raise ValueError(f"no simulator for implementation {name!r} (it must read the implementation's shard "
                         f"layout); simulated: {', '.join(SIMULATORS)}")
    return SIMULATORS[name]()
