"""The unsharded reference's results, computed once per rank process and shared by every cell that
asks for the same training.

The yardstick's run depends on the initial model, the per-rank batches, the recipe, the mixed
precision, the gradient divide factor, the device, the backend and the rank's place in its group;
it does not depend on how a candidate shards (strategy, units, mesh), nor on which candidate runs. So the FULL_SHARD,
SHARD_GRAD_OP, NO_SHARD and HYBRID_SHARD cells of one workload, and the same cell of every
implementation of one `shardcheck run`, compare with one recorded run:

    key(cell) = (build, recipe, mixed precision, gradient divide factor, device, backend, rank, group ranks,
                 digest of the model's type, repr, initial parameters and buffers and the
                 batches, for every rank of the group)

A cell replays the recording only when every rank of its group holds it (one all-reduce decides), so
ranks never disagree on whether the yardstick issues its collectives. A run is recorded only when it
completed every step and drew no random numbers (replaying it would change what the candidate draws
next). A key that missed an input would make cells fail loudly against the wrong expectation, never
pass quietly: a candidate cannot match a yardstick it was not trained like.

`computed_once` does the same for a check that writes its reference side as a function of its
parameters (clip_grad's DDP parity: one reference per (max_norm, norm_type), shared by the strategies
and offload settings).
"""

from __future__ import annotations

import collections
import threading

import torch
import torch.distributed as dist

from shardcheck.conformance.protocol import StepResult

CAPACITY = 256  # recordings per process (small models: tens of KB each)
_STORE: collections.OrderedDict = collections.OrderedDict()
_LOCK = threading.Lock()  # thread mode: every rank of the world shares this process's store


def key(ctx, build, model: torch.nn.Module, spec, recipe, batches: list) -> tuple | None:
    """What the reference's run on this rank depends on (see the module docstring): `model` as built,
    untrained, and the batches of EVERY rank, since the averaged gradients are made of them all.
    None (nothing is shared) when some rank's inputs have no digest (`shardcheck.harness.digest`).
    Collective: every rank of the group calls it (one all-gather of the ranks' digests)."""
    identity = f"{type(model).__module__}.{type(model).__qualname__}\n{model!r}\n{model.training}"
    every_rank = tuple(ctx.digests((identity, dict(model.named_parameters()),
                                    dict(model.named_buffers()), batches)))
    if None in every_rank:
        return None
    # `build` and the recipe's loss function compare by identity: a closure made per cell never
    # matches another cell's, and an object cannot be freed (and its id reused) while a key holds it.
    policies = tuple(spec.policies(model.named_modules()).items())  # each module's mixed precision
    return (build, recipe, policies, spec.gradient_divide_factor, *_place(ctx), every_rank)


def _place(ctx) -> tuple:
    """Where a rank's run happens: device, backend, rank, and the ranks of its group."""
    group_ranks = tuple(dist.get_process_group_ranks(ctx.group)) if ctx.group is not None else None
    return str(ctx.device), ctx.backend, ctx.rank, group_ranks


def _kept(cell_key: tuple):
    """What this process keeps for `cell_key`, or None."""
    with _LOCK:
        value = _STORE.get(cell_key)
        if value is not None:
            _STORE.move_to_end(cell_key)
        return value


def _keep(cell_key: tuple, value) -> None:
    with _LOCK:
        _STORE[cell_key] = value
        while len(_STORE) > CAPACITY:
            _STORE.popitem(last=False)


def _held_by_every_rank(ctx, held: bool) -> bool:
    flag = torch.tensor([1 if held else 0], dtype=torch.int32, device=ctx.device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=ctx.group)
    return bool(flag.item())


def replay_or_record(ctx, cell_key: tuple | None, compute):
    """A `Replay` of the recorded run for `cell_key` if every rank holds one; otherwise a `Recording`
    of `compute()` (a `DataParallelReference`), to be `keep`-ed once its steps are done (never
    kept when `cell_key` is None)."""
    steps = None if cell_key is None else _kept(cell_key)
    if _held_by_every_rank(ctx, steps is not None):
        return Replay(steps)
    return Recording(compute(), cell_key, ctx.device)


def computed_once(ctx, compute, *args):
    """``compute(ctx, *args)``: a check's reference side, returning tensors in dicts, lists and
    tuples, computed once per rank process for every cell that passes the same `compute` and `args`
    on the same device, backend, rank and group; later cells get copies.

    `compute` must depend on nothing else: it builds its own model and draws its inputs under
    `ctx.seeded`. A result is kept only if `compute` left the random number generators as it found
    them. As with `replay_or_record`, every rank recomputes unless every rank holds the result."""
    cell_key = (compute, args, *_place(ctx))
    kept = _kept(cell_key)
    if _held_by_every_rank(ctx, kept is not None):
        return _copied(kept)
    before = _rng_states(ctx.device)
    result = compute(ctx, *args)
    if not _rng_moved(before, ctx.device):
        _keep(cell_key, _copied(result))
    return result


def _copied(value):
    """`value` with every tensor detached and cloned: what a cell gets cannot change what is kept."""
    if torch.is_tensor(value):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: _copied(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_copied(v) for v in value)
    return value


def _rng_states(device: torch.device) -> list[torch.Tensor]:
    states = [torch.get_rng_state()]
    if device.type == "cuda":
        states.append(torch.cuda.get_rng_state(device))
    return states


def _rng_moved(before: list[torch.Tensor], device: torch.device) -> bool:
    """Whether a generator's state differs from `before` (`_rng_states` taken earlier)."""
    return any(not torch.equal(a, b) for a, b in zip(before, _rng_states(device)))


class Recording:
    """The reference, with every output of every step copied as it is produced. A step is
    {"evals": [loss, ...], "losses": [loss per micro-batch], "grads", "result", "params"}; it opens
    at its first evaluate or forward_backward and closes with full_params."""

    def __init__(self, reference, cell_key: tuple, device: torch.device) -> None:
        self.reference, self.key, self.device, self.steps = reference, cell_key, device, []
        self.drew_random = False

    def _watch(self, call):
        before = _rng_states(self.device)
        out = call()
        self.drew_random |= _rng_moved(before, self.device)
        return out

    def _open(self) -> dict:
        if not self.steps or "params" in self.steps[-1]:
            self.steps.append({"evals": [], "losses": []})
        return self.steps[-1]

    def set_requires_grad(self, names, flag: bool) -> None:
        self.reference.set_requires_grad(names, flag)

    def evaluate(self, batch) -> torch.Tensor:
        loss = self._watch(lambda: self.reference.evaluate(batch))
        self._open()["evals"].append(_copied(loss))
        return loss

    def forward_backward(self, batch) -> torch.Tensor:
        loss = self._watch(lambda: self.reference.forward_backward(batch))
        self._open()["losses"].append(_copied(loss))
        return loss

    def full_grads(self) -> dict:
        grads = self.reference.full_grads()
        self.steps[-1]["grads"] = _copied(grads)
        return grads

    def step(self) -> StepResult:
        result = self._watch(self.reference.step)
        self.steps[-1]["result"] = result
        return result

    def full_params(self) -> dict:
        params = self.reference.full_params()
        self.steps[-1]["params"] = _copied(params)
        return params

    def keep(self) -> None:
        """Store the run for later cells: only a complete one that drew no random numbers."""
        complete = all({"grads", "result", "params"} <= s.keys() and s["losses"] for s in self.steps)
        if self.key is None or self.drew_random or not self.steps or not complete:
            return
        _keep(self.key, self.steps)


class Replay:
    """The same interface, answered from a recording, step by step and micro-batch by micro-batch."""

    def __init__(self, steps: list) -> None:
        self.steps, self.i, self.closed = steps, -1, True

    def _open(self) -> dict:
        if self.closed:
            self.i, self.closed, self.evals, self.micro = self.i + 1, False, 0, 0
        return self.steps[self.i]

    def set_requires_grad(self, names, flag: bool) -> None:
        pass  # the recipe, schedule included, is in the key: the recording made the same changes

    def evaluate(self, batch) -> torch.Tensor:
        step = self._open()
        self.evals += 1
        return step["evals"][self.evals - 1]

    def forward_backward(self, batch) -> torch.Tensor:
        step = self._open()
        self.micro += 1
        return step["losses"][self.micro - 1]

    def full_grads(self) -> dict:
        return self.steps[self.i]["grads"]

    def step(self) -> StepResult:
        return self.steps[self.i]["result"]

    def full_params(self) -> dict:
        self.closed = True
        return self.steps[self.i]["params"]

    def keep(self) -> None:
        pass
