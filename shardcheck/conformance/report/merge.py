"""`shardcheck report merge PART... -o OUT`: the reports of the parts of a split run
(shardcheck.conformance.report.split) joined into one report, as the unsplit run would have written it:
the same schema, the union of the parts' cells, the summary, coverage and conformance counted over
that union, and `split.parts` saying which parts it holds.

A set that is not every part of one split exactly once is refused (PartsError, one line): a file
that is not a part (an unsplit run, or a merged report), parts of different selections or plans
(other durations), of another implementation or torch release, a part given twice, or one missing.
The joined report is `complete` when every part is and together they hold every cell of the selection.
"""

from __future__ import annotations

import datetime as dt
import os
from pathlib import Path

from shardcheck.conformance.report import writer
from shardcheck.errors import PARTS, ShardcheckError


class PartsError(ShardcheckError):
    """Parts that do not join into one run: the message is one line."""

    exit_status = PARTS


def _who(report: dict) -> tuple:
    """What every part must share besides its selection: the implementations and the torch they ran on."""
    return (tuple((i["name"], i["selected_as"], i["version"]) for i in report["implementations"]),
            report["target"]["torch"])


def check(parts: list[tuple[str, dict]]) -> None:
    """PartsError unless `parts` ([(path, report read with reading.load)]) are every part of one split once."""
    if not parts:
        raise PartsError("no part given")
    for path, report in parts:
        made = report.get("split")
        if made is None:
            raise PartsError(f"{path}: not a part of a split run (no `split`: run with --split K/N)")
        if "part" not in made:
            raise PartsError(f"{path}: a merged report (parts {', '.join(str(p['part']) for p in made['parts'])} "
                             f"of {made['of']}), not a part: merge the parts themselves")
    first_path, first = parts[0]
    one = first["split"]
    for path, report in parts[1:]:
        made = report["split"]
        if (made["selection"], made["of"]) != (one["selection"], one["of"]):
            raise PartsError(f"{path} is part {made['part']}/{made['of']} of another selection ({made['cells']} cells, "
                             f"{made['selection']}) than {first_path} ({one['part']}/{one['of']}: {one['cells']} cells, "
                             f"{one['selection']})")
        if made["plan"] != one["plan"]:
            raise PartsError(f"{path} and {first_path} split the same cells differently (planned from other "
                             "durations: give every part the same --durations)")
        if _who(report) != _who(first):
            raise PartsError(f"{path} ran other implementations or another torch than {first_path}: "
                             f"{_who(report)} against {_who(first)}")
    seen: dict[int, str] = {}
    for path, report in parts:
        part = report["split"]["part"]
        if part in seen:
            raise PartsError(f"part {part}/{one['of']} given twice: {seen[part]} and {path}")
        seen[part] = path
    missing = sorted(set(range(1, one["of"] + 1)) - set(seen))
    if missing:
        raise PartsError(f"part{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))} of {one['of']} "
                         f"missing (given: {', '.join(map(str, sorted(seen)))})")


def _exit_status(codes: list[int | None]) -> int | None:
    """The joined run's pytest exit status: None if a part's session did not finish, 0 when every
    part's was 0, else the one that says most (an interruption or an error over failed cells)."""
    if any(code is None for code in codes):
        return None
    bad = [code for code in codes if code not in (0, 5)]  # 5: a part that held no cell
    return 0 if not bad else max(bad, key=lambda code: (code != 1, code))


def merge(parts: list[tuple[str, dict]], out: Path) -> dict:
    """The joined report of `parts` (checked first: PartsError), paths in it relative to `out`'s folder."""
    check(parts)
    parts = sorted(parts, key=lambda pair: pair[1]["split"]["part"])
    folder = out.absolute().parent
    first = parts[0][1]
    cells, explore, seen = [], [], set()
    for path, report in parts:
        for cell in report["cells"]:
            if cell["nodeid"] in seen:
                raise PartsError(f"{path}: cell {cell['nodeid']} is in another part too")
            seen.add(cell["nodeid"])
            cells.append(cell)
        explore += report.get("explore") or []
    started = min(dt.datetime.fromisoformat(r["started"]) for _, r in parts)
    finished = max(dt.datetime.fromisoformat(r["finished"]) for _, r in parts)
    one = first["split"]

    def relative(path: str | Path) -> str:
        return os.path.relpath(Path(path).absolute(), folder)

    held = [{"part": r["split"]["part"], "report": relative(path), "cells": len(r["cells"]),
             "complete": r["complete"], "started": r["started"], "finished": r["finished"],
             "exit_status": r["exit_status"], "device_model": r["target"]["device_model"],
             "full_text": relative(Path(path).absolute().parent / r["full_text"]) if r.get("full_text") else None}
            for path, r in parts]
    head = {**{k: first[k] for k in ("suite", "implementations", "target")},
            "started": started.isoformat(), "finished": finished.isoformat(),
            "duration_s": (finished - started).total_seconds(),
            "complete": all(r["complete"] for _, r in parts) and len(cells) == one["cells"],
            "exit_status": _exit_status([r["exit_status"] for _, r in parts]),
            "split": {"of": one["of"], "selection": one["selection"], "plan": one["plan"], "cells": one["cells"],
                      "timed": one["timed"], "parts": held}}
    return writer.compose(head, cells, None, explore)
