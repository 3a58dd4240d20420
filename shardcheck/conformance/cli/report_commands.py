"""`shardcheck report assemble` (a report from the cells a run streamed, e.g. after a crash),
`shardcheck report upgrade` (an earlier schema version rewritten as the current one) and
`shardcheck report merge` (the parts of a split run joined into one report, report/merge.py)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from shardcheck.conformance.cli import exit_codes as codes


def add_parser(subparsers) -> None:
    report = subparsers.add_parser("report", help="work with conformance reports").add_subparsers(
        dest="report_command", required=True)
    assemble = report.add_parser("assemble", help="rebuild a JSON report from its JSON-lines stream "
                                                  "(an interrupted run's is marked complete: false)")
    assemble.add_argument("jsonl", metavar="JSONL", help="the cells streamed by a run (REPORT.jsonl)")
    assemble.add_argument("-o", "--output", help="report path (default: JSONL without its final 'l')")
    upgrade = report.add_parser("upgrade", help="rewrite a report of an earlier schema version as the current "
                                                "one; prints its size before and after")
    upgrade.add_argument("report", metavar="REPORT", help="the JSON report (any version this shardcheck reads)")
    upgrade.add_argument("-o", "--output", help="where to write it (default: over REPORT)")
    merge = report.add_parser("merge", help="join the reports of the parts of a split run (run --split K/N) "
                                            f"into one; a part missing or repeated is refused (exit {codes.PARTS})")
    merge.add_argument("parts", nargs="+", metavar="PART", help="every part's JSON report, each once")
    merge.add_argument("-o", "--output", required=True, help="where to write the joined report")


def main(args) -> int:
    return {"assemble": assemble, "upgrade": upgrade, "merge": merge}[args.report_command](args)


def _refuse_unwritable(out: Path) -> int:
    """UNWRITABLE after one line when the report cannot be written at `out`, else OK."""
    from shardcheck.conformance.report.stream import unwritable

    if problem := unwritable(out, stream=False):
        print(f"shardcheck: -o/--output: cannot write the report: {problem}", file=sys.stderr)
        return codes.UNWRITABLE
    return codes.OK


def merge(args) -> int:
    """The parts' reports joined (shardcheck.conformance.report.merge): exit 0 when written; 2 a part
    that is not a readable report (ReportError); 3 an output that cannot be written; PARTS a set that
    is not every part of one split run once (PartsError)."""
    from shardcheck.conformance.report import merge as joining
    from shardcheck.conformance.report import writer as reporting
    from shardcheck.conformance.report.reading import load, validate

    out = Path(args.output)
    if refused := _refuse_unwritable(out):  # before anything is read
        return refused
    parts = [(path, load(path)) for path in args.parts]  # a part that is no report: `shardcheck: ...`
    args.prog = "shardcheck report merge"  # parts that are no split run: its errors' one line (cli/main.py)
    report = joining.merge(parts, out)
    if problem := validate(report):  # never write a report that fails the schema
        print(f"shardcheck report merge: cannot make a valid report: {problem}", file=sys.stderr)
        return codes.USAGE
    reporting.write(report, out)
    counts = ", ".join(f"{n} {outcome}" for outcome, n in sorted(report["summary"]["by_outcome"].items()))
    print(f"shardcheck: report written to {out} ({len(report['cells'])} cells of {report['split']['cells']} "
          f"from {len(parts)} parts: {counts}; complete: {str(report['complete']).lower()})")
    return codes.OK


def assemble(args) -> int:
    """The report from the cells a run streamed: exit 0 when written; 2 a stream that is missing or holds
    no valid report (StreamError); 3 an output that cannot be written."""
    from shardcheck.conformance.report import writer as reporting
    from shardcheck.conformance.report.reading import validate

    lines = Path(args.jsonl)
    if not lines.is_file():
        print(f"shardcheck: no such file: {lines}", file=sys.stderr)
        return codes.USAGE
    out = Path(args.output or (str(lines)[:-1] if lines.suffix == ".jsonl" else f"{lines}.json"))
    if refused := _refuse_unwritable(out):  # before anything is read
        return refused
    try:
        report = reporting.assemble(lines)
    except OSError as exc:  # a stream that cannot be read: what was given is not a stream
        print(f"shardcheck: {exc}", file=sys.stderr)
        return codes.USAGE
    if problem := validate(report):  # never write a report that fails the schema
        print(f"shardcheck: {lines}: cannot make a valid report: {problem}", file=sys.stderr)
        return codes.USAGE
    reporting.write(report, out)
    print(f"shardcheck: report written to {out} ({len(report['cells'])} cells, "
          f"complete: {str(report['complete']).lower()})")
    return codes.OK


def upgrade(args) -> int:
    """An earlier schema version rewritten as the current one: exit 0 when written; 2 a file that is not a
    readable report (ReportError); 3 an output that cannot be written."""
    from shardcheck.conformance.report import writer as reporting
    from shardcheck.conformance.report.reading import load

    source, out = Path(args.report), Path(args.output or args.report)
    if source.is_file() and (refused := _refuse_unwritable(out)):  # before anything is read
        return refused
    report = load(source)
    stream = reporting.stream_path(source)
    full_text = os.path.relpath(stream.absolute(), out.absolute().parent) if stream.is_file() else None
    before = source.stat().st_size
    reporting.write(reporting.rewrite(report, full_text), out)
    after = out.stat().st_size
    print(f"shardcheck: {source} (schema version {report['schema_version']}, {before:,} bytes) written as "
          f"version {reporting.SCHEMA_VERSION} to {out} ({after:,} bytes, {after / before:.1%})")
    return codes.OK
