"""Every known failure says what kind it is and where it stands upstream (issue 61): each manifest
entry has a `kind` from shardcheck/conformance/expectations/kinds.py (a `document` URL where it is
"by design"), each FINDINGS.md finding a `- Kind:` and an `- Upstream:` line, the two agree, and an
unreported bug that was searched for has its ready-to-file report in expectations/upstream/."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

from shardcheck.conformance.expectations import kinds

ROOT = Path(__file__).resolve().parents[2]
EXPECTATIONS = ROOT / "shardcheck" / "conformance" / "expectations"
UPSTREAM = EXPECTATIONS / "upstream"


def _sections(text: str) -> dict[str, str]:
    parts = re.split(r"^## (F\d+)\b", text, flags=re.MULTILINE)
    return {parts[i]: parts[i + 1].split("\n## ")[0] for i in range(1, len(parts), 2)}


def _line(section: str, name: str) -> str | None:
    found = re.search(rf"^- {name}: (.+)$", section, flags=re.MULTILINE)
    return found.group(1).strip() if found else None


def finding_kind(section: str) -> str | None:
    """The kind a finding's `- Kind:` line starts with (the longest match: "by design" before "bug")."""
    line = _line(section, "Kind")
    if line is None:
        return None
    return next((k for k in sorted(kinds.KINDS, key=len, reverse=True) if line == k or line.startswith(k + " ")), None)


def problems(findings_text: str, manifests: dict[str, dict]) -> list[str]:
    """What issue 61 forbids, one line each: a finding without a Kind (one of kinds.KINDS) or an
    Upstream line; a manifest entry without a valid kind; an entry whose kind is not its finding's;
    a searched, unreported bug without its report in expectations/upstream/."""
    out = []
    sections = _sections(findings_text)
    for finding, section in sections.items():
        kind = finding_kind(section)
        if kind is None:
            out.append(f"{finding}: no '- Kind: <{'|'.join(kinds.KINDS)}>' line")
        upstream = _line(section, "Upstream")
        if not upstream:
            out.append(f"{finding}: no '- Upstream:' line")
        elif kind == kinds.BUG and upstream.startswith("unreported (searched") \
                and not (UPSTREAM / f"{finding}.md").is_file():
            out.append(f"{finding}: unreported bug without its report upstream/{finding}.md")
    for name, tables in manifests.items():
        for table in ("xfail", "explore"):
            for i, entry in enumerate(tables.get(table, [])):
                where = f"{name} {table} entry {i + 1} ({entry.get('finding', 'no finding')})"
                bad = kinds.problem(entry)
                if bad:
                    out.append(f"{where}: {bad}")
                elif entry.get("finding") in sections and finding_kind(sections[entry["finding"]]) != entry["kind"]:
                    out.append(f"{where}: kind {entry['kind']!r} but FINDINGS.md says "
                               f"{finding_kind(sections[entry['finding']])!r}")
    return out


def _manifests() -> dict[str, dict]:
    return {p.name: tomllib.loads(p.read_text()) for p in sorted(EXPECTATIONS.glob("*.toml"))}


def test_every_finding_and_manifest_entry_has_a_kind_and_an_upstream_status():
    assert problems((EXPECTATIONS / "FINDINGS.md").read_text(), _manifests()) == []


def test_a_missing_kind_or_upstream_line_is_refused():
    good = "## F1 - x\n- Kind: bug\n- Upstream: pytorch/pytorch#1 (open)\n"
    entry = {"cells": ["a"], "reason": "r", "repro": "r.py", "error": "e", "finding": "F1", "kind": "bug"}
    assert problems(good, {"m.toml": {"xfail": [entry]}}) == []
    assert problems("## F1 - x\n- Upstream: none\n", {}) == ["F1: no '- Kind: <bug|by design|platform|misuse>' line"]
    assert problems("## F1 - x\n- Kind: regression\n- Upstream: none\n", {})[0].startswith("F1: no '- Kind:")
    assert problems("## F1 - x\n- Kind: bug\n", {}) == ["F1: no '- Upstream:' line"]
    assert problems("## F1 - x\n- Kind: bug\n- Upstream: unreported (searched: x)\n", {}) == [
        "F1: unreported bug without its report upstream/F1.md"]
    no_kind = {k: v for k, v in entry.items() if k != "kind"}
    assert problems(good, {"m.toml": {"xfail": [no_kind]}})[0].startswith("m.toml xfail entry 1 (F1): kind = None")
    design = {**entry, "kind": "by design"}
    assert "needs document" in problems(good, {"m.toml": {"explore": [design]}})[0]
    assert problems(good, {"m.toml": {"xfail": [{**design, "document": "https://x.org/doc"}]}}) == [
        "m.toml xfail entry 1 (F1): kind 'by design' but FINDINGS.md says 'bug'"]


def test_the_manifest_loader_refuses_an_entry_without_a_kind(tmp_path):
    from shardcheck.conformance.expectations import manifest

    class Adapter:
        name, version = "x", "1.0"
        expectations = str(tmp_path / "x.toml")

    (tmp_path / "x.toml").write_text('[[xfail]]\ncells = ["a"]\nreason = "r"\nrepro = "r.py"\nerror = "e"\n')
    with pytest.raises(manifest.ManifestError, match="lacks kind"):
        manifest.load(Adapter())
    (tmp_path / "x.toml").write_text('[[xfail]]\ncells = ["a"]\nreason = "r"\nrepro = "r.py"\nerror = "e"\nkind = "feature"\n')
    with pytest.raises(manifest.ManifestError, match="'feature' is not one of"):
        manifest.load(Adapter())
    (tmp_path / "x.toml").write_text('[[xfail]]\ncells = ["a"]\nreason = "r"\nrepro = "r.py"\nerror = "e"\nkind = "platform"\n'
                                     'backends = ["gloo"]\n')
    assert [e["kind"] for e in manifest.load(Adapter())] == ["platform"]


def test_kinds_of_findings_come_from_the_manifests():
    table = kinds.of_findings()
    assert table["F48"] == ("by design", "https://docs.pytorch.org/docs/stable/generated/"
                                         "torch.nn.parallel.DistributedDataParallel.html", "DDP")
    assert {f: table[f][0] for f in ("F13", "F24", "F43", "F56", "F62", "F9")} == {
        "F13": "by design", "F24": "by design", "F43": "by design", "F56": "by design",
        "F62": "platform", "F9": "bug"}
    assert kinds.of_expectation({"finding": "F9", "reason": "r", "repro": "r"}) == ("bug", None, None)
    assert kinds.of_expectation({"finding": "F999"}) == ("bug", None, None)  # unknown: the conservative verdict
    assert kinds.of_expectation(None) == ("bug", None, None)
    assert kinds.label("by design", "https://d", "DDP") == "differs from DDP, by design (https://d)"


def test_ready_to_file_reports_say_what_a_maintainer_needs():
    reports = sorted(UPSTREAM.glob("F*.md"))
    assert reports, "no report in expectations/upstream/"
    findings = _sections((EXPECTATIONS / "FINDINGS.md").read_text())
    for report in reports:
        text = report.read_text()
        assert text.startswith("# "), report.name  # the title
        for heading in ("## Reproduction", "```python", "## Expected", "## Actual", "## Versions"):
            assert heading in text, f"{report.name} lacks {heading}"
        assert "from _launch import" not in text and "import shardcheck" not in text \
            and "from shardcheck" not in text, f"{report.name}: the repro must stand alone"
        assert report.stem in findings and f"upstream/{report.stem}.md" in findings[report.stem], \
            f"FINDINGS.md's {report.stem} does not cite {report.name}"
