"""Expectation manifests: an implementation's known failures, turned into strict xfails.

    [[xfail]]
    cells = ["test_clip_grad.py::test_ddp_parity[ws4-*-inf-FULL_SHARD-*]"]   # globs over cell ids
    reason = "why it fails: the root cause, with the source line where known"
    repro = "shardcheck/conformance/expectations/repros/fsdp2_inf_norm_empty_shard.py"  # a runnable file in the repo
    error = "cannot compute the infinity norm on an empty tensor"  # a regex the failure must show
    kind = "bug"            # bug, by design, platform or misuse: expectations/kinds.py, docs/findings.md
    finding = "F9"          # optional: the FINDINGS.md entry (the matrix groups by it)
    torch = ">=2.13,<2.14"  # optional: torch versions the entry applies to
    version = "<0.20"       # optional: versions of the implementation itself
    variants = ["flat"]     # optional: only these variants ("default": the plain name); else all
    backends = ["gloo", "threaded"]  # cells on these backends only (required of kind "platform": the
                            # platform it is a limitation of; gloo ranks compute on the CPU)
    document = "https://..."  # where the engine documents the behaviour: required for kind "by design"
    convention = "DDP"      # optional, "by design": whose convention the cell judges by ("differs from DDP")

Any other key is an error, so is an entry without cells, reason, repro, error and kind, or with a
kind outside shardcheck/conformance/expectations/kinds.py's KINDS. `error` is a
Python regex, compiled when the manifest loads (a bad one is an error) and searched (re.search) in
the failure text of each cell the entry marks (what the run prints and the report keeps: for a
distributed cell the ranks' verdict, headline and rank blocks): a cell that fails with a text it
does not find fails the run, naming the entry (shardcheck/conformance/plugins/expected_errors.py). So
an entry excuses its bug, not any failure of its cells; write the narrowest phrase of the actual
error ("infinity norm on an empty tensor", not "AssertionError"), an alternation only for two
phrasings of the same bug, and split an entry whose cells fail for different reasons.

`shardcheck explore` (shardcheck/conformance/explore/) recognises its known findings by `[[explore]]` entries:
`facts` (named properties of the drawn configuration) and `error` (a regex the failure must show)
instead of `cells`; the other keys as above. shardcheck/conformance/explore/findings.py says how they match. A manifest path given by
an adapter (its `expectations` attribute) is relative to the adapter's module file. Variants of an
implementation (`torch-fsdp1[flat]`) share its manifest.

A loaded entry is the table as written plus `_path` (the manifest's path) and, where it has an
`error`, `_error` (the compiled regex).
"""

from __future__ import annotations

import inspect
import re
import tomllib
from pathlib import Path

import torch
from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import InvalidVersion, Version

from shardcheck.conformance.expectations import kinds
from shardcheck.errors import UsageError
from shardcheck.harness.vocabulary import BACKENDS

HERE = Path(__file__).parent
REQUIRED = {"cells", "reason", "repro", "error", "kind"}
EXPLORE_REQUIRED = {"facts", "error", "reason", "repro", "kind"}
OPTIONAL = {"finding", "torch", "version", "variants", "document", "convention", "backends"}


class ManifestError(UsageError, ValueError):
    """A manifest that cannot be read or holds an entry that is not well formed: one line."""


def path_of(adapter) -> Path:
    """The adapter's own manifest (relative to its module file), else expectations/<base name>.toml."""
    given = getattr(adapter, "expectations", None)
    if given:
        given = Path(given)
        if not given.is_absolute():
            given = Path(inspect.getfile(type(adapter))).parent / given
        return given
    return HERE / f"{adapter.name.partition('[')[0]}.toml"


def _version(text: str) -> Version | None:
    try:
        return Version(text.split("+")[0])
    except InvalidVersion:
        return None


def _applies(entry: dict, adapter, where: str) -> bool:
    if "variants" in entry:
        variant = adapter.name.partition("[")[2].rstrip("]") or "default"
        if variant not in entry["variants"]:
            return False
    for key, current in (("torch", torch.__version__), ("version", adapter.version)):
        if key not in entry:
            continue
        try:
            spec = SpecifierSet(entry[key])
        except InvalidSpecifier:
            raise ManifestError(f"{where}: {key} = {entry[key]!r} is not a version range") from None
        version = _version(str(current))
        if version is None or version not in spec:
            return False
    return True


def load(adapter) -> list[dict]:
    """The entries of `adapter`'s manifest that apply to the installed torch and implementation."""
    return _load(adapter, "xfail", REQUIRED)


def load_explore(adapter) -> list[dict]:
    """The `[[explore]]` entries of `adapter`'s manifest that apply (explore's known findings)."""
    entries = _load(adapter, "explore", EXPLORE_REQUIRED)
    for entry in entries:
        if not isinstance(entry["facts"], dict) or not isinstance(entry["error"], str):
            raise ManifestError(f"{entry['_path']}: an explore entry needs facts (a table) and error (a regex)")
    return entries


NO_REASON = "no reason given (add it to the manifest's [unsupported] table)"


def unsupported(adapter) -> dict[str, str]:
    """The manifest's `[unsupported]` table: {capability: why the engine cannot do it}, one line each
    (the engine's own limit and where it is documented; "adapter gap: ..." where only the adapter
    has not wired what the engine offers). Its keys must be capabilities of the vocabulary."""
    from shardcheck.conformance.protocol.capabilities import unknown

    path = path_of(adapter)
    if not path.exists():
        return {}
    try:
        table = tomllib.loads(path.read_text()).get("unsupported", {})
    except tomllib.TOMLDecodeError as exc:
        raise ManifestError(f"{path}: {exc}") from None
    bad = unknown(table) + [k for k, v in table.items() if not isinstance(v, str) or not v.strip() or "\n" in v]
    if bad:
        raise ManifestError(f"{path} [unsupported]: {', '.join(bad)}: a key must be a capability "
                            "(shardcheck/conformance/protocol/capabilities.py), its value one line")
    return table


def why_not(adapter, capability: str) -> str:
    """Why `adapter` does not declare `capability` (its manifest's `[unsupported]` line), or NO_REASON."""
    return unsupported(adapter).get(capability) or NO_REASON


def unexplained(adapter) -> list[str]:
    """The capabilities `adapter` neither declares nor explains (none, for a built-in adapter)."""
    from shardcheck.conformance.protocol.capabilities import CAPABILITIES

    reasons = unsupported(adapter)
    return sorted(c for c in CAPABILITIES if c not in adapter.capabilities and c not in reasons)


def _load(adapter, table: str, required: set[str]) -> list[dict]:
    path = path_of(adapter)
    if not path.exists():
        if getattr(adapter, "expectations", None):
            raise ManifestError(f"{adapter.name}: expectations manifest {path} does not exist")
        return []
    try:
        entries = tomllib.loads(path.read_text()).get(table, [])
    except tomllib.TOMLDecodeError as exc:
        raise ManifestError(f"{path}: {exc}") from None
    out = []
    for i, entry in enumerate(entries):
        where = f"{path} {table} entry {i + 1}"
        missing, extra = required - set(entry), set(entry) - required - OPTIONAL
        if missing:
            raise ManifestError(f"{where} lacks {', '.join(sorted(missing))}")
        if extra:
            raise ManifestError(f"{where}: unknown key(s) {', '.join(sorted(extra))} "
                                f"(known: {', '.join(sorted(required | OPTIONAL))})")
        bad_kind = kinds.problem(entry)
        if bad_kind:
            raise ManifestError(f"{where}: {bad_kind} (shardcheck/conformance/expectations/kinds.py)")
        if table == "xfail" and (not isinstance(entry["cells"], list) or not entry["cells"]):
            raise ManifestError(f"{where}: cells must be a non-empty list of globs")
        bad_backends = _backends_problem(entry, table)
        if bad_backends:
            raise ManifestError(f"{where}: {bad_backends}")
        compiled = {"_error": _compiled(entry["error"], where)} if "error" in entry else {}
        if _applies(entry, adapter, where):
            out.append({**entry, "_path": str(path), **compiled})
    return out


def _backends_problem(entry: dict, table: str) -> str | None:
    """A platform limitation says which platform: its cells on another backend are judged as any."""
    if "backends" not in entry:
        if table == "xfail" and entry.get("kind") == "platform":
            return ('kind "platform" needs backends = [...]: the backends whose platform it is a limitation '
                    'of (its cells elsewhere must pass)')
        return None
    named = entry["backends"]
    if not isinstance(named, list) or not named or not all(b in BACKENDS for b in named):
        return f"backends must be a non-empty list of {', '.join(BACKENDS)}, not {named!r}"
    return None


def on_backend(entry: dict, backend: str) -> bool:
    """Whether `entry` applies to a cell run on `backend`."""
    return backend in entry.get("backends", (backend,))


def _compiled(pattern, where: str) -> re.Pattern:
    """The entry's `error` regex compiled: a manifest with a bad one does not load."""
    if not isinstance(pattern, str) or not pattern:
        raise ManifestError(f"{where}: error must be a non-empty regex string, not {pattern!r}")
    try:
        return re.compile(pattern)
    except re.error as exc:
        raise ManifestError(f"{where}: error {pattern!r} is not a regex: {exc}") from None
