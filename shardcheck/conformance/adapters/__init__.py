"""Adapters shipped with shardcheck, and how any adapter is found by name.

`load("reference")` finds a built-in adapter or one registered by a third-party package under the
entry-point group `shardcheck.adapters`; `load("pkg.module:attr")` imports one directly (the attribute
may be an adapter instance, or a class / factory called with no arguments). `load("name[variant]")`
calls the class with `variant=...`: a variant is one configuration of an implementation's own knobs
(`torch-fsdp1[flat]`), listed in the adapter's `variants` and reported as its own row. `all` (on the
command line) is every built-in implementation and variant whose dependencies are installed.
"""

from __future__ import annotations

import difflib
import importlib
from pathlib import Path
from importlib.metadata import entry_points

from shardcheck.builtin_adapters import BUILTIN  # the built-in adapters' names and classes: data the entry point reads too
from shardcheck.conformance.protocol import Adapter, required
from shardcheck.conformance.protocol.capabilities import CAPABILITIES, unknown
from shardcheck.errors import ADAPTER_IMPORT, UnknownName

ENTRY_POINT_GROUP = "shardcheck.adapters"


class UnknownAdapter(UnknownName):
    """An implementation, variant or capability that names nothing: one line (exit status 4)."""


class AdapterImportError(UnknownAdapter):
    """An adapter that cannot be built: its module raised while it was imported (any exception, an
    ImportError of a dependency included), its class or factory raised when called, or it lacks a
    method what it declares needs (protocol/required.py). The CLI's exit status 6."""

    exit_status = ADAPTER_IMPORT


_EXAMPLE = Path(__file__).parents[1] / "examples" / "allreduce_engine.py"  # ships with the package


def available() -> dict[str, str]:
    found = dict(BUILTIN)
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        found.setdefault(ep.name, ep.value)
    return found


def _import(target: str):
    module_name, _, attr = target.partition(":")
    obj = importlib.import_module(module_name)
    for part in attr.split(".") if attr else []:
        obj = getattr(obj, part)
    return obj


def split_variant(spec: str) -> tuple[str, str | None]:
    """`torch-fsdp1[flat]` -> (`torch-fsdp1`, `flat`); `reference` -> (`reference`, None)."""
    if spec.endswith("]") and "[" in spec:
        base, _, variant = spec[:-1].partition("[")
        return base, variant
    return spec, None


def every_builtin() -> tuple[list[str], dict[str, str]]:
    """What `--impl all` means: every built-in implementation and each of its variants whose
    dependencies are installed; and, for the others, why they were left out (`{name: reason}`)."""
    names, left_out = [], {}
    for name, target in BUILTIN.items():
        try:
            obj = _import(target)
        except ImportError as exc:
            left_out[name] = str(exc)
            continue
        names += [name] + [f"{name}[{variant}]" for variant in getattr(obj, "variants", {})]
    return names, left_out


def load(spec: str) -> Adapter:
    names = available()
    spec, variant = split_variant(spec)
    target = names.get(spec, spec if ":" in spec else None)
    if target is None:
        raise UnknownAdapter(f"unknown implementation {spec!r}; available: {', '.join(sorted(names))} "
                             f"(or give pkg.module:attr)")
    module_name, _, attr = target.partition(":")
    try:
        obj = _import(target)
    except ModuleNotFoundError as exc:
        if exc.name is None or not (module_name == exc.name or module_name.startswith(exc.name + ".")):
            raise _broken(spec, f"importing {target}", exc) from None  # a module the adapter imports
        raise UnknownAdapter(f"cannot load implementation {spec!r} from {target}: {exc}") from None
    except AttributeError as exc:
        raise UnknownAdapter(f"cannot load implementation {spec!r} from {target}: {exc}") from None
    except Exception as exc:  # the adapter's own module is broken: one line, not pytest's INTERNALERROR
        raise _broken(spec, f"importing {target}", exc) from None
    if variant is not None:
        known = getattr(obj, "variants", {})
        if variant not in known:
            raise UnknownAdapter(f"{spec} has no variant {variant!r}; variants: "
                                 f"{', '.join(sorted(known)) or 'none'}")
    try:
        if variant is not None:
            adapter = obj(variant=variant)
        else:
            adapter = obj() if isinstance(obj, type) or (callable(obj) and not isinstance(obj, Adapter)) else obj
    except Exception as exc:
        raise _broken(spec, f"calling {target}", exc) from None
    if not isinstance(adapter, Adapter):
        raise UnknownAdapter(f"{target} is not a shardcheck adapter: it needs name, version, "
                             f"capabilities and trainer() (a worked example: {_EXAMPLE})")
    bad = unknown(adapter.capabilities)
    if bad:
        raise UnknownAdapter(f"{spec} declares unknown capabilities {', '.join(map(_suggest, bad))} "
                             f"(the vocabulary: shardcheck/conformance/protocol/capabilities.py)")
    gaps = required.missing(adapter)
    if gaps:
        raise AdapterImportError(f"implementation {spec!r}: {', '.join(gaps)} missing, required by what it "
                                 f"declares (shardcheck/conformance/protocol/required.py)")
    return adapter


def _broken(spec: str, doing: str, exc: BaseException) -> AdapterImportError:
    first = (str(exc).strip().splitlines() or [""])[0]
    return AdapterImportError(f"implementation {spec!r}: {doing} raised {type(exc).__name__}: {first}")


def _suggest(name: str) -> str:
    """`name`, with the capability it most likely misspells: "ful_shard (did you mean full_shard?)"."""
    close = difflib.get_close_matches(name, CAPABILITIES, n=1)
    return f"{name} (did you mean {close[0]}?)" if close else name
