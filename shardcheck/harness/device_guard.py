"""A second device on a CPU machine: what a test body builds on the host while its rank computes on
`ctx.device`, caught without a GPU.

On a GPU rank (`ctx.device` cuda:0) a tensor made without a device lives on the CPU, and the first
operation that mixes it with the rank's tensors raises "Expected all tensors to be on the same
device". On a CPU machine both are the CPU and nothing shows. With SHARDCHECK_DEVICE_GUARD=1 every
body runs under `DeviceGuard`, a torch function mode that gives each storage a home, as a GPU run
would place it:

- **host**: made by a factory without a device (`torch.randn(4)`, `nn.Linear(2, 2)`), or moved
  there by `.cpu()`;
- **rank**: made or moved with a `torch.device` (`device=ctx.device`, `.to(ctx.device)`,
  `model.to(ctx.device)`, `device=p.device` of a rank tensor);
- otherwise the home of the inputs (views, `*_like`, `new_*`, results of operations);
- none for "cpu" by name: here it means either (a mesh's device type is "cpu" on this machine where
  a GPU run says "cuda").

An operation whose inputs hold both homes (0-dim host tensors excepted, as CUDA allows CPU scalars)
raises `DeviceMismatch`, naming the operation and where the host tensor was made. Copies between
homes (`copy_`, `__setitem__`, `.to`) are what a GPU run allows. A tensor the guard never saw made
(a gradient autograd made, a DTensor) has no home and is never blamed: the guard can miss, never
invent, a mismatch. tests/harness/test_device_guard.py shows each rule.
"""

from __future__ import annotations

import os
import sys

import torch
from torch.overrides import TorchFunctionMode
from torch.utils.weak import WeakIdKeyDictionary
from shardcheck.errors import ShardcheckError

ENV = "SHARDCHECK_DEVICE_GUARD"
HOST, RANK = "host", "rank"
FACTORIES = frozenset({
    "tensor", "as_tensor", "asarray", "from_numpy", "empty", "zeros", "ones", "full", "rand", "randn",
    "randint", "randperm", "arange", "range", "linspace", "logspace", "eye", "empty_strided",
    "scalar_tensor", "tril_indices", "triu_indices", "normal", "bernoulli", "multinomial"})
LIKE = frozenset({"empty_like", "zeros_like", "ones_like", "full_like", "rand_like", "randn_like",
                  "randint_like", "new_empty", "new_zeros", "new_ones", "new_full", "new_tensor",
                  "new_empty_strided"})
CROSSING = frozenset({"copy_", "__setitem__", "to", "cpu", "cuda", "_parse_to", "set_", "__get__",
                      "__set__", "is_same_size", "equal_device", "numel", "dim", "size", "stride",
                      "data_ptr", "untyped_storage", "storage_offset", "element_size", "is_contiguous",
                      "requires_grad_", "detach", "detach_", "item", "tolist", "__repr__", "__format__",
                      "_has_compatible_shallow_copy_type", "is_floating_point", "is_complex", "__len__"})
_THIS_FILE = __file__
_TORCH_DIR = os.path.dirname(torch.__file__)


class DeviceMismatch(ShardcheckError, RuntimeError):
    """A body mixed host and rank tensors in one operation (a GPU run raises here)."""


def active() -> bool:
    return os.environ.get(ENV) == "1"


def _storage(t):
    if not isinstance(t, torch.Tensor) or t.device.type == "meta":
        return None
    try:
        return t.untyped_storage()
    except (RuntimeError, NotImplementedError, TypeError):
        return None  # a wrapper subclass (DTensor), a sparse tensor: no storage of its own


def _site() -> str:
    frame = sys._getframe(2)
    while frame is not None and (frame.f_code.co_filename == _THIS_FILE or
                                 frame.f_code.co_filename.startswith(_TORCH_DIR)):
        frame = frame.f_back
    return f"{frame.f_code.co_filename}:{frame.f_lineno}" if frame is not None else "torch"


def _tensors(obj, out: list):
    if isinstance(obj, torch.Tensor):
        out.append(obj)
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            _tensors(item, out)
    elif isinstance(obj, dict):
        for item in obj.values():
            _tensors(item, out)
    return out


class DeviceGuard(TorchFunctionMode):
    """See the module's docstring. One per rank body (torch function modes are per thread)."""

    def __init__(self):
        super().__init__()
        self.homes = WeakIdKeyDictionary()  # storage -> (home, where it was made)
        self.devices: dict[int, tuple[torch.device, str]] = {}  # device objects seen made -> home

    # ------------------------------------------------------------------ homes
    def home_of(self, t) -> str | None:
        return self._entry(t)[0]

    def _entry(self, t) -> tuple[str | None, str | None]:
        storage = _storage(t)
        entry = self.homes.get(storage) if storage is not None else None
        return entry if entry else (None, None)

    def _place(self, result, home: str | None, site: str | None = None) -> None:
        if home is None:
            return
        site = site if site is not None else _site() if home == HOST else ""
        for t in _tensors(result, []):
            storage = _storage(t)
            if storage is not None:
                self.homes[storage] = (home, site)

    def _device_home(self, device) -> str | None:
        """The home a device argument means: a torch.device is the rank's (`ctx.device`, a rank
        tensor's `.device`) unless the guard saw it read off a host tensor; "cpu" by name means
        either here (a mesh's device type is "cpu" on this machine, "cuda" on a GPU): no home."""
        if device is None:
            return None
        if isinstance(device, str):
            return None if device.split(":")[0] == "cpu" else RANK
        if isinstance(device, torch.device):
            seen = self.devices.get(id(device))
            return seen[1] if seen is not None and seen[0] is device else RANK
        if isinstance(device, int):
            return RANK
        return None

    def _remember_device(self, device, home: str | None) -> None:
        if len(self.devices) > 10_000:
            self.devices.clear()
        self.devices[id(device)] = (device, home)

    # ------------------------------------------------------------------ the mode
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        result = func(*args, **kwargs) if name in CROSSING or name == "device" else None
        if name == "device" and isinstance(result, torch.device):  # torch.device(...) made here
            source = args[0] if args else kwargs.get("type")
            self._remember_device(result, self._device_home(source))
            return result
        if name == "__get__" and args:  # an attribute of a tensor: its .device, its .grad
            home, site = self._entry(args[0])
            if home is not None and isinstance(result, torch.device):
                self._remember_device(result, home)
            elif home is not None and isinstance(result, torch.Tensor) and self.home_of(result) is None:
                self._place(result, home, site)  # autograd makes a gradient where its parameter lives
            return result
        if name == "_parse_to" and isinstance(result, tuple) and isinstance(result[0], torch.device):
            source = args[0] if args and isinstance(args[0], (str, torch.device)) else kwargs.get("device")
            self._remember_device(result[0], self._device_home(source))  # Module.to's device, as given
            return result
        if name == "cuda":
            self._place(result, RANK)
            return result
        if name in ("cpu", "to"):
            home, site, moves = (HOST, None, True) if name == "cpu" else self._to_home(args, kwargs)
            if moves and result is args[0] and self.home_of(args[0]) not in (None, home):
                result = result.clone()  # a move between homes copies, as it does on a GPU
            self._place(result, home, site)
            return result
        if name in CROSSING:
            return result
        if name in FACTORIES:
            result = func(*args, **kwargs)
            device = kwargs.get("device")
            home = self._device_home(device) if device is not None else \
                self._inputs_home(name, args, kwargs)[0] or HOST  # no device: torch's default, the host
            self._place(result, home)
            return result
        home, site = self._inputs_home(name, args, kwargs)
        result = func(*args, **kwargs)
        if name in LIKE and kwargs.get("device") is not None:
            home, site = self._device_home(kwargs["device"]), None
        self._place(result, home, site)  # a host result keeps where its host input was made
        return result

    def _to_home(self, args, kwargs) -> tuple[str | None, str | None, bool]:
        """Where `tensor.to(...)` puts its result: (home, where a host result was made, whether it
        names a device). Another tensor's home, a device's (none for "cpu" by name), else its own."""
        self_tensor, rest = args[0], list(args[1:])
        target = kwargs.get("device")
        for arg in rest:
            if isinstance(arg, torch.Tensor):
                return (*self._entry(arg), True)
            if isinstance(arg, (str, torch.device, int)) and not isinstance(arg, bool) and target is None:
                target = arg
        if target is None:
            return (*self._entry(self_tensor), False)
        return self._device_home(target), None, True

    def _inputs_home(self, name: str, args, kwargs) -> tuple[str | None, str | None]:
        """The one home of the inputs and where the first host input was made; DeviceMismatch when
        they hold both."""
        seen: dict[str, str] = {}
        for t in _tensors(args, _tensors(kwargs, [])):
            storage = _storage(t)
            entry = self.homes.get(storage) if storage is not None else None
            if entry is None or (entry[0] == HOST and t.dim() == 0):
                continue  # unknown, or a host scalar (CUDA takes CPU scalars)
            seen.setdefault(entry[0], entry[1])
        if len(seen) > 1:
            raise DeviceMismatch(
                f"Expected all tensors to be on the same device (shardcheck's device guard): {name} got "
                f"tensors on the rank's device and on the host; the host tensor was made at {seen[HOST]} "
                f"without the rank's device (ctx.device)")
        home = next(iter(seen), None)
        return home, seen.get(home)
