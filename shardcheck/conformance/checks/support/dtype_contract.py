"""The mixed-precision dtype contract, observed at every boundary of a candidate's run.

`Watch` installs the suite's own hooks on the user's modules (the objects the candidate was given,
so they fire whatever the engine wraps them in) and logs the collectives of each phase
(shardcheck/conformance/measure/traffic.py). Each module is under the policy of the unit holding it
(ShardSpec.policies: one policy, or one per unit); with policy (param_dtype p, reduce_dtype q,
buffer_dtype b; q defaults to p, p to float32, b to the buffer's dtype as built) the facts must be:

* forward: every floating parameter a module's forward sees, and every floating input it gets, is
  in its p (in training and in evaluation forwards alike), and every floating buffer of its own in b;
* input cast: an input that requires a gradient as the caller passes it still requires one after
  the engine's forward pre-hooks (a cast outside autograd drops every gradient behind it);
* backward: every floating reduce-scatter or all-reduce issued by forward_backward is a gradient
  reduction and travels in the q of some unit; with gradients synced on the last micro-batch only,
  the first k-1 micro-batches issue none, and the gradients they leave held (where the trainer shows
  them: `held_grads`) are summed in a q, or in float32 or wider;
* step: floating all-reduces (norms, inf checks) travel in float32 or wider, whatever the
  gradients' dtype.

`verify` raises one line naming the first broken boundary (the step, the phase, what was seen and
the policy), on every rank if any rank saw one; a phase that raises after a broken boundary (a
buffer in the wrong dtype that an operator then refuses) raises that line instead.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_leaves

from shardcheck.conformance.measure.traffic import CollectiveCounter

WIDE = (torch.float32, torch.float64)


def _name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _floats(args, kwargs) -> list[torch.Tensor]:
    return [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor) and t.is_floating_point()]


def _policy_text(mp) -> str:
    compute = mp.param_dtype if mp is not None and mp.param_dtype else torch.float32
    reduce = mp.reduce_dtype if mp is not None and mp.reduce_dtype else compute
    text = f"policy param_dtype={_name(compute)}, reduce_dtype={_name(reduce)}"
    return text + (f", buffer_dtype={_name(mp.buffer_dtype)}" if mp is not None and mp.buffer_dtype else "")


class Watch:
    """Observers of one candidate run; `modules` is {path: (module, parameter names, {buffer name:
    dtype})} of the user's model as built (names and dtypes taken before the engine may have moved
    the parameters off the modules or cast the buffers)."""

    def __init__(self, ctx, modules: dict, spec, recipe, trainer=None) -> None:
        self.ctx, self.recipe = ctx, recipe
        self.held_grads = getattr(trainer, "held_grads", lambda: None)
        self.policies = spec.policies((path, m) for path, (m, *_) in modules.items())
        self.reduce = {mp.reduce_dtype or mp.param_dtype or torch.float32 if mp else torch.float32
                       for mp in self.policies.values()}
        self.place, self.evaluated, self.problems, self.handles, self.passed = "", False, [], [], {}
        for path, (module, names, buffers) in modules.items():
            self.handles.append(module.register_forward_pre_hook(
                self._before(path), prepend=True, with_kwargs=True))
            self.handles.append(module.register_forward_pre_hook(
                self._after(path, module, names, buffers), with_kwargs=True))

    def _compute(self, path: str) -> torch.dtype:
        mp = self.policies[path]
        return mp.param_dtype if mp is not None and mp.param_dtype else torch.float32

    # -- forward: hooks before and after the engine's own pre-hooks ---------------------------
    def _before(self, path):
        def hook(module, args, kwargs):
            self.passed[path] = [t.requires_grad for t in _floats(args, kwargs)]
        return hook

    def _after(self, path, module, names, buffers):
        label, compute, mp = path or "the root module", self._compute(path), self.policies[path]

        def hook(_, args, kwargs):
            seen = _floats(args, kwargs)
            for i, (t, had) in enumerate(zip(seen, self.passed.pop(path, []))):
                if had and not t.requires_grad and torch.is_grad_enabled():
                    self._note(f"input {i} of {label} lost its gradient at the engine's input cast "
                               f"(requires_grad before its pre-hooks, not after; now {_name(t.dtype)})", path)
            for i, t in enumerate(seen):
                if t.dtype != compute:
                    self._note(f"input {i} of {label} reaches its forward in {_name(t.dtype)}", path)
            for name in names:
                p = getattr(module, name, None)
                if isinstance(p, torch.Tensor) and p.is_floating_point() and p.dtype != compute:
                    self._note(f"parameter {path + '.' if path else ''}{name} seen by forward in {_name(p.dtype)}", path)
            for name, built in buffers.items():
                b, want = getattr(module, name, None), (mp.buffer_dtype if mp and mp.buffer_dtype else built)
                if isinstance(b, torch.Tensor) and b.is_floating_point() and b.dtype != want:
                    self._note(f"buffer {path + '.' if path else ''}{name} seen by forward in {_name(b.dtype)}", path)
        return hook

    # -- phases and collectives -------------------------------------------------------------
    @contextlib.contextmanager
    def during(self, step: int, phase: str, micro: int = 0):
        """Observe `phase` ("eval", "forward_backward", "step") of `step`; check its collectives."""
        k = self.recipe.accumulation_steps
        self.place = f"step {step}" + (f" micro-batch {micro}" if phase == "forward_backward" and k > 1 else "") + \
            f" ({phase})"
        with CollectiveCounter() as log:
            try:
                yield
            except Exception as exc:
                if self.problems:  # the broken boundary, not the operator that then refused it
                    raise AssertionError(f"{self.problems[0]} (then {type(exc).__name__}: "
                                         f"{str(exc).splitlines()[0][:200]})") from exc
                raise
        reductions = [c for c in log.calls if c.reduces_floats]
        after_eval = " after an eval forward" if self.evaluated else ""
        if phase == "eval":
            self.evaluated = True
        elif phase == "forward_backward":
            quiet = not self.recipe.sync_each_micro_batch and micro < k - 1
            if quiet and reductions:
                self._note(f"gradients reduced ({reductions[0].kind}) on a micro-batch that no_sync "
                           f"should keep local (sync on the last of {k} only)")
            held = self.held_grads() if quiet else None
            low = next((g.dtype for g in held or () if g.is_floating_point() and g.dtype not in self.reduce | set(WIDE)), None)
            if low is not None:
                self._note(f"gradients held across no_sync micro-batches in {_name(low)} (each micro-batch "
                           f"added in {_name(low)}, not in the reduce dtype)")
            for c in reductions:
                if c.dtype not in self.reduce:
                    self._note(f"gradients reduced in {_name(c.dtype)} ({c.kind}){after_eval}")
                    break
        elif phase == "step":
            for c in reductions:
                if c.kind == "all_reduce" and c.dtype not in WIDE:
                    self._note(f"a norm or inf check reduced in {_name(c.dtype)} (float32 or wider expected)")
                    break

    def _note(self, what: str, path: str = "") -> None:
        self.problems.append(f"{self.place}: {what}; {_policy_text(self.policies[path])}")

    def verify(self) -> None:
        """Raise the first broken boundary, on every rank if any rank saw one (a collective)."""
        flag = torch.tensor([1 if self.problems else 0], dtype=torch.int32, device=self.ctx.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.ctx.group)
        if flag.item():
            raise AssertionError(self.problems[0] if self.problems else
                                 "dtype contract: another rank observed a broken boundary")

    def close(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []
