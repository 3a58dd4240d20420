"""What explore reports, and what it already knows.

A finding is a failing configuration, shrunk, with its failure's signature and message, the seed that
found it, and a one-line reproducer: `shardcheck explore --replay FILE` on the JSON written for it
(`replay_document`). Known findings come from the implementation's expectations manifest
(shardcheck/conformance/expectations/<impl>.toml), in `[[explore]]` tables:

    [[explore]]
    facts = { norm_type = "inf", empty_shard = true }   # every named fact of the configuration
    error = "cannot compute the infinity norm on an empty tensor"   # a regex searched in the failure
    reason = "..."; repro = "shardcheck/conformance/expectations/repros/....py"; finding = "F9"
    torch = ">=2.13,<2.14"   # optional, as for [[xfail]] (also version, variants)

A failing example is known when every fact matches (`config.Config.facts()`: a value equal to the
fact, a list of values one of which equals it, or, for a list-valued fact such as `strategies`, a
value it contains) AND the error regex is found in the failure's message. Both are required, so an
entry never excuses a different failure of the same configuration, nor the same error elsewhere.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from shardcheck.conformance.expectations import manifest
from shardcheck.conformance.explore.config import Config, from_json, to_json

MESSAGE_LIMIT = 4000
FACT_NAMES = frozenset(Config(world_size=1, widths=(1, 1), bias=(False,)).facts())


def manifest_entries(adapter) -> list[dict]:
    """The adapter's `[[explore]]` entries that apply to the installed versions, facts checked."""
    entries = manifest.load_explore(adapter)
    for entry in entries:
        unknown = set(entry["facts"]) - FACT_NAMES
        if unknown:
            raise manifest.ManifestError(f"{entry['_path']}: explore entry facts {', '.join(sorted(unknown))} "
                                         f"unknown (known: {', '.join(sorted(FACT_NAMES))})")
    return entries


def fact_matches(actual, wanted) -> bool:
    """One fact: equal; `wanted` a list: actual is one of them; `actual` a list: it contains wanted."""
    if isinstance(actual, list) and not isinstance(wanted, list):
        return wanted in actual
    if isinstance(wanted, list):
        return actual in wanted
    return actual == wanted


def known_entry(entries: list[dict], config: Config, outcome) -> dict | None:
    """The first entry whose facts all hold for `config` and whose error is in the failure."""
    facts = config.facts()
    for entry in entries:
        if all(fact_matches(facts[k], v) for k, v in entry["facts"].items()) and \
                re.search(entry["error"], outcome.message):
            return entry
    return None


def replay_command(path: str | Path) -> str:
    return f"shardcheck explore --replay {path}"


@dataclass(frozen=True)
class Finding:
    """A new failure: the implementation, the seed of the search, the shrunk configuration, the
    failure's signature and (trimmed) message."""

    impl: str
    seed: int
    config: Config
    signature: str
    message: str

    @classmethod
    def of(cls, impl: str, seed: int, config: Config, outcome) -> "Finding":
        text = outcome.message
        if len(text) > MESSAGE_LIMIT:
            text = text[:MESSAGE_LIMIT] + f"\n[... {len(outcome.message) - MESSAGE_LIMIT} characters trimmed]"
        return cls(impl, seed, config, outcome.signature, text)

    def to_json(self, replay_file: str | None = None) -> dict:
        out = {"impl": self.impl, "seed": self.seed, "signature": self.signature,
               "config": to_json(self.config), "message": self.message}
        if replay_file:
            out["replay_file"] = str(replay_file)
            out["reproducer"] = replay_command(replay_file)
        return out


def replay_document(finding: Finding) -> dict:
    """The contents of a FILE for `shardcheck explore --replay FILE`: one finding."""
    return {"kind": "shardcheck-explore-finding", **finding.to_json()}


def replay_targets(path: Path) -> list[tuple[str, Config]]:
    """(impl, config) of every finding in `path`: a finding file, or a whole explore report."""
    data = json.loads(path.read_text())
    if data.get("kind") == "shardcheck-explore-finding":
        return [(data["impl"], from_json(data["config"]))]
    found = [f for run in data.get("explore", []) for f in run.get("findings", [])]
    if not found:
        raise ValueError(f"{path}: neither an explore finding nor a report with findings")
    return [(f["impl"], from_json(f["config"])) for f in found]
