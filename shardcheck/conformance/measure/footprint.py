"""A trainer's footprint on one rank: what it holds between steps, what a step adds, and what it
sends, measured around any engine's `Trainer` (shardcheck.conformance.protocol) by the suite's own instruments.

`measure` builds the model and the trainer under a `MemoryTracker`, so every byte counted is one the
model or the engine allocated, and runs the given steps. The figures are those of the LAST step
(the first allocates the optimizer's state lazily), each in bytes on this rank:

    rest        {kind: bytes} held after the step (MemoryTracker.kinds), and their total
    forward     held at the end of forward less held before it: saved activations, and parameters
                left gathered (read inside the loss function, where forward has ended)
    kept        the gathered bytes alive at the end of forward that were gathered during it
                (MemoryTracker.gathered_since): parameters an engine left gathered, counted gross,
                so a free elsewhere in forward is no credit
    gathered    {"forward", "backward"}: the most gathered bytes alive at any moment of each
    backward    held after forward_backward less held before it: gradients, and whatever else
                backward left behind
    gradients   the bytes of `.grad` tensors after forward_backward, plus the bytes the step
                allocated outside any `.grad`, parameter or optimizer state and still holds after
                backward: gradients an engine keeps in its own buffers (buckets, flat partitions)
    peak        the most held during forward_backward, less held before it
    traffic     the step's collectives (forward_backward and step): by kind, calls, volume, bytes
                sent per rank in a ring (traffic.Collective.sent), dtypes and group sizes
    construction  the most held at once while the model was built and the trainer made: the whole
                model for one built on the CPU, this rank's shards (one unit at a time for FSDP1)
                for one built on meta (capability meta_init)
"""

from __future__ import annotations

import dataclasses
import gc
from typing import Callable

import torch

from shardcheck.conformance.measure.memory import MemoryTracker
from shardcheck.conformance.protocol.adapter import on_meta
from shardcheck.conformance.measure.traffic import CollectiveCounter


def measure(ctx, build: Callable[[], torch.nn.Module], make_trainer: Callable, recipe, batches: list) -> dict:
    """Train `make_trainer(model, recipe)` on `batches` (this rank's, one per step) from `build()`
    (seeded alike on every rank); return the figures of the module doc for the last step."""
    ends: list[tuple[int, int, int]] = []  # (held, kept gathered, gathered peak) at each end of forward

    def loss_fn(model, batch):  # the end of forward, as the engine runs it
        loss = recipe.loss_fn(model, batch)
        ends.append((mem.settled(), mem.gathered_since(epoch), mem.gathered_peak))
        mem.mark_gathered()  # what follows is backward's
        return loss

    with MemoryTracker(ctx.device) as mem:
        with ctx.seeded(0):
            model = build()
        if not on_meta(model):  # a meta model is the trainer's to materialize (capability meta_init)
            model = model.to(ctx.device)
        trainer = make_trainer(model, dataclasses.replace(recipe, loss_fn=loss_fn))
        del model  # what the engine keeps of it is the engine's
        construction = mem.peak  # the most alive at once while the model was built and handed over
        try:
            for i, batch in enumerate(batches):
                gc.collect()
                mem.settled()
                before = mem.mark()
                epoch = mem.epoch
                with CollectiveCounter() as counter:
                    trainer.forward_backward(batch)
                    after_backward, peak, backward_gathered = mem.settled(), mem.peak, mem.gathered_peak
                    if i == len(batches) - 1:
                        gradients = _gradient_bytes(mem, epoch)
                    trainer.step()
            gc.collect()
            mem.settled()
            rest = mem.kinds()
        finally:
            if hasattr(trainer, "close"):
                trainer.close()
    held_at_end, kept, forward_gathered = ends[-1]
    return {"rest": {**rest, "total": sum(rest.values())}, "forward": held_at_end - before, "kept": kept,
            "gathered": {"forward": forward_gathered, "backward": backward_gathered},
            "backward": after_backward - before, "gradients": gradients, "peak": peak - before,
            "traffic": traffic_table(counter), "construction": construction}


def _gradient_bytes(mem: MemoryTracker, epoch: int) -> int:
    """Gradients wherever the engine keeps them: `.grad` tensors, and the storages born in this step
    that nothing names (no `.grad`, parameter or optimizer state) and that are not gathered
    parameters, still alive after backward."""
    claims = mem.claims()
    unnamed_new = mem.kinds(born_since=epoch, without_gathered=True, claims=claims)["other"]
    return mem.kinds(claims=claims)["gradients"] + unnamed_new


def traffic_table(counter: CollectiveCounter) -> dict[str, dict]:
    """{kind: {"calls", "volume", "sent", "dtypes", "group_sizes"}} of the counted collectives."""
    out: dict[str, dict] = {}
    for c in counter.calls:
        row = out.setdefault(c.kind, {"calls": 0, "volume": 0, "sent": 0.0, "dtypes": [], "group_sizes": []})
        row["calls"] += 1
        row["volume"] += c.volume
        row["sent"] += c.sent
        n = len(c.ranks) if c.ranks else None
        dtype = None if c.dtype is None else str(c.dtype).removeprefix("torch.")
        for key, value in (("dtypes", dtype), ("group_sizes", n)):
            if value is not None and value not in row[key]:
                row[key].append(value)
    return out
