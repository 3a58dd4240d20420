"""A cell's failure text as the report keeps it: one text per cell, ranks that said the same grouped,
tracebacks trimmed to the frames a reader needs. The full text stays in the run's JSON-lines stream
(the report's `full_text` names it), bounded by MESSAGE_LIMIT alone.

The harness joins the ranks' texts (shardcheck.harness.verdict.decide) as a headline, then one block per
failed rank under `---------- rank R ----------`. `trim`:

- keeps one block per distinct text: a rank whose text is the same as an earlier rank's (memory
  addresses aside) is named in that block's title (`---------- rank 1 (the same: ranks 0, 3) ----------`);
- in each `Traceback (most recent call last):` keeps the frames in the suite (shardcheck/conformance/checks,
  shardcheck/conformance/adapters: where the check and the adapter were), the frame where the call left the
  suite for the implementation, and the frame that raised; a line says how many frames were cut;
  caret lines (`^^^^`) go;
- writes file paths from the package or the checkout down (`torch/distributed/fsdp/_flat_param.py`,
  `shardcheck/conformance/checks/api/test_clip_grad.py`), memory addresses in rank blocks as `0x…` (the
  headline, which the matrix and diff show, stays as it was), and cuts lines longer than LINE_LIMIT
  characters;
- bounds the headline and each block to `limit` characters (head and tail kept, `bounded`).

`pieces` cuts a trimmed text where its rank blocks begin: the report stores each distinct piece
once (a block many cells share is written once).
"""

from __future__ import annotations

import re

MESSAGE_LIMIT = 64 * 1024  # characters of a cell's message kept (head and tail): the stream's bound
KNOWN_FAILURE_LIMIT = 512  # an xfailed cell's headline and each block, in the report: its expectation says why
SUITE = ("/conformance/checks/", "/conformance/adapters/")  # frames kept: the check's and the adapter's
# pytest-xdist heads a worker's failure text with the worker and interpreter: `[gw1] linux -- Python 3.11.7 ...`
WORKER_LINE = re.compile(r"\A\[gw\d+\] [^\n]* -- Python [^\n]*\n")


def without_worker_line(text: str) -> str:
    """A failure text without the line pytest-xdist puts before it (its first line is the failure's)."""
    return WORKER_LINE.sub("", text)
LINE_LIMIT = 400  # characters of a line the report keeps (head and tail)
RANK_TITLE = re.compile(r"^---------- rank (\d+)( \(consequence\))? ----------$", re.M)
ANY_TITLE = re.compile(r"^---------- rank \d+.* ----------$", re.M)
FRAME = re.compile(r'^  File "(?P<path>[^"]+)", line \d+, in .*$')
TORN_FRAME = re.compile(r'^(?:[^"]*")?(?P<path>[^"]*)", line \d+, in \S+$')  # what follows a CUT
CUT = re.compile(r"^\[\.\.\. \d+ characters cut by shardcheck \.\.\.\]$")
ADDRESS = re.compile(r"0x[0-9a-f]{6,}")
CARETS = re.compile(r"^\s*[~^]+\s*$")
PREFIX = re.compile(r'(?<=File ")[^"]*?/(?:site-packages/|dist-packages/|(?=shardcheck/))')


def bounded(text: str, limit: int = MESSAGE_LIMIT) -> str:
    """`text` if it fits in `limit` characters, else its head and tail around a marker."""
    if len(text) <= limit:
        return text
    marker = "\n[... {} characters cut by shardcheck ...]\n"
    keep = limit - len(marker.format(len(text)))
    head = keep * 3 // 4
    return text[:head] + marker.format(len(text) - keep) + text[len(text) - (keep - head):]


def _frames(lines: list[str]) -> tuple[list[list[str]], int]:
    """The frames at the start of `lines` (a traceback's, after its first line) and how many lines
    they take. A frame: its `File` line, then its source and caret lines."""
    frames: list[list[str]] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        torn = i > 0 and CUT.match(lines[i - 1])
        if FRAME.match(line) or (torn and TORN_FRAME.match(line)):
            frames.append([line])
        elif frames and (line.startswith("    ") or CUT.match(line) or torn):
            frames[-1].append(line)
        else:
            break
        i += 1
    return frames, i


def _path(frame_line: str) -> str:
    match = FRAME.match(frame_line) or TORN_FRAME.match(frame_line)
    return match["path"] if match else ""


def _kept(frames: list[list[str]]) -> list[bool]:
    """The suite's frames, the first after each run of them (into the implementation), the last."""
    suite = [any(part in "/" + _path(f[0]) for part in SUITE) for f in frames]
    return [s or (i > 0 and suite[i - 1]) or i == len(frames) - 1 for i, s in enumerate(suite)]


def trim_tracebacks(text: str) -> str:
    """Every `Traceback (most recent call last):` in `text` with its frames trimmed (module doc)."""
    lines = text.split("\n")
    out: list[str] = []
    i = 0
    while i < len(lines):
        out.append(lines[i])
        i += 1
        if not out[-1].startswith("Traceback (most recent call last):"):
            continue
        frames, used = _frames(lines[i:])
        i += used
        cut = 0
        for frame, kept in zip(frames, _kept(frames)):
            if not kept:
                cut += 1
                out.extend(line for line in frame if CUT.match(line))  # an earlier cut stays said
                continue
            if cut:
                out.append(f"  [... {cut} frame{'s' if cut > 1 else ''} cut by shardcheck ...]")
                cut = 0
            out.extend(line for line in frame if not CARETS.match(line))
        if cut:
            out.append(f"  [... {cut} frame{'s' if cut > 1 else ''} cut by shardcheck ...]")
    return "\n".join(out)


def _same(text: str) -> str:
    return ADDRESS.sub("0x…", text.strip())


def _blocks(message: str) -> tuple[str, list[tuple[str, str]]]:
    """(headline, [(title, text)]) of a harness message; (message, []) for any other."""
    titles = list(ANY_TITLE.finditer(message))
    ends = [t.start() for t in titles[1:]] + [len(message)]
    head = message[:titles[0].start()].rstrip("\n") if titles else message
    return head, [(t[0], message[t.end():end].strip("\n")) for t, end in zip(titles, ends)]


def group_ranks(message: str) -> str:
    """The harness's message with ranks that said the same folded into the first one's block."""
    head, blocks = _blocks(message)
    groups: list[tuple[str, list[str], str]] = []  # (title, [the same ranks], text)
    for title, text in blocks:
        match = RANK_TITLE.match(title)
        twin = next((g for g in groups if match and _same(g[2]) == _same(text)), None)
        if twin is not None:
            twin[1].append(match[1])
        else:
            groups.append((title, [], text))
    parts = [head]
    for title, same, text in groups:
        if same:
            title = title.removesuffix(" ----------") + (f" (the same: rank{'s' if len(same) > 1 else ''} "
                                                          f"{', '.join(same)}) ----------")
        parts += [title, text]
    return "\n".join(parts)


def _line(line: str) -> str:
    return bounded(line, LINE_LIMIT).replace("\n", " ") if len(line) > LINE_LIMIT else line


def trim(message: str, limit: int = MESSAGE_LIMIT) -> str:
    """The text the report keeps for a cell's `message` (module doc)."""
    if not message:
        return message
    text = "\n".join(_line(PREFIX.sub("", line)) for line in trim_tracebacks(group_ranks(message)).split("\n"))
    head, blocks = _blocks(text)
    return "\n".join([bounded(head, limit)] + [part for title, body in blocks
                                                for part in (title, bounded(ADDRESS.sub("0x…", body), limit))])


def pieces(text: str) -> list[str]:
    """`text` cut before and after each rank block's title: joined with newlines, `text` again."""
    head, blocks = _blocks(text)
    return [head] + [part for title, body in blocks for part in (title, body)]
