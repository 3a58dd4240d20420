"""The exit status of `shardcheck run` (and the other commands where the class applies), one per
class of outcome, so a script can tell a broken implementation from a mistyped command:

    0    every collected cell reached its expected outcome (xfailed and unsupported cells included)
    1    a cell failed or errored, an implementation reached no cell, coverage below --min-coverage,
         or (diff) a regression or an incomplete report
    2    usage: a bad option value
    3    an output path that cannot be written (a folder, a file where a folder should be, no right,
         another live run's report)
    4    an unknown name: implementation, variant, family
    5    no cell selected (--family, --world-sizes, -k and --impl left none)
    6    an adapter whose module raised while it was imported
    7    report merge: parts that do not make one split run (a part missing or given twice, parts of
         another selection or split plan, a report that is not a part)
    130  interrupted (Ctrl-C, however many): the report says complete: false
"""

import signal

OK, FAILED, USAGE, UNWRITABLE, UNKNOWN_NAME, NO_CELL, ADAPTER_IMPORT, PARTS = 0, 1, 2, 3, 4, 5, 6, 7
INTERRUPTED = 128 + signal.SIGINT  # 130, as a shell reports a process ended by Ctrl-C
