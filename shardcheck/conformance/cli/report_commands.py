"""`shardcheck report assemble` (a report from the cells a run streamed, e.g. after a crash) and
`shardcheck report upgrade` (an earlier schema version rewritten as the current one)."""

from __future__ import annotations

import os
import sys
from pathlib import Path


def assemble(args) -> int:
    from shardcheck.conformance.report import writer as reporting

    lines = Path(args.jsonl)
    if not lines.is_file():
        print(f"shardcheck: no such file: {lines}", file=sys.stderr)
        return 2
    out = Path(args.output or (str(lines)[:-1] if lines.suffix == ".jsonl" else f"{lines}.json"))
    from shardcheck.conformance.report.reading import validate

    try:
        report = reporting.assemble(lines)
    except (reporting.StreamError, OSError) as exc:
        print(f"shardcheck: {exc}", file=sys.stderr)
        return 2
    problem = validate(report) or reporting.unwritable(out, stream=False)
    if problem:  # never write a report that fails the schema
        print(f"shardcheck: {lines}: cannot make a valid report: {problem}", file=sys.stderr)
        return 2
    reporting.write(report, out)
    print(f"shardcheck: report written to {out} ({len(report['cells'])} cells, "
          f"complete: {str(report['complete']).lower()})")
    return 0


def upgrade(args) -> int:
    from shardcheck.conformance.report import writer as reporting
    from shardcheck.conformance.report.reading import ReportError, load

    source, out = Path(args.report), Path(args.output or args.report)
    try:
        report = load(source)
    except ReportError as exc:
        print(f"shardcheck: {exc}", file=sys.stderr)
        return 2
    stream = reporting.stream_path(source)
    full_text = os.path.relpath(stream.absolute(), out.absolute().parent) if stream.is_file() else None
    before = source.stat().st_size
    problem = reporting.unwritable(out, stream=False)
    if problem:
        print(f"shardcheck: -o/--output: cannot write the report: {problem}", file=sys.stderr)
        return 2
    reporting.write(reporting.rewrite(report, full_text), out)
    after = out.stat().st_size
    print(f"shardcheck: {source} (schema version {report['schema_version']}, {before:,} bytes) written as "
          f"version {reporting.SCHEMA_VERSION} to {out} ({after:,} bytes, {after / before:.1%})")
    return 0
