"""The parser of ``kvparity``, assembled from the commands, one module
each: its name, help, arguments and handler. ``kvparity.reports.cli`` runs
it and turns what a handler returns or raises into the exit status. A new
command is its module plus one entry in ``COMMANDS``."""

import argparse

from kvparity.oracle.models import available_models
from kvparity.reports.commands import (
    bench, bisect, calibrate, check, compare, fuzz, matrix, merge, models, probe, record, replay, run,
)

COMMANDS = (run, bench, check, merge, matrix, replay, bisect, fuzz, models, probe, record, calibrate, compare)

EXAMPLES = """examples:
  kvparity run                                   the catalog against the reference cache
  kvparity run --impl myserver.cache:BatchCache  ... against your implementation
  kvparity run --model smollm2                   L2 on the real SmolLM2-135M
  kvparity replay found.json --level L1          one schedule, row by row
  kvparity fuzz --workers 2 --minutes 10         generated schedules, shrunk failures
  git bisect run kvparity check --impl myserver.cache:BatchCache
                                                 find the commit that broke parity
  kvparity check --shard 1/2 --out s1; kvparity check --shard 2/2 --out s2; kvparity merge s1 s2
                                                 one verdict from two machines

models: {models}

exit status: 0 parity holds, 1 parity broken, 2 usage error, 125 cannot judge here,
128 the harness itself failed (aborts git bisect run), 130 interrupted
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvparity",
        description="Parity harness for batched, affine-quantized KV caches on MLX: "
        "every row of a batch must match the same request run alone through mlx-lm, byte for byte.",
        epilog=EXAMPLES.format(models=", ".join(available_models())),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for command in COMMANDS:
        options = sub.add_parser(command.NAME, help=command.HELP, description=command.DESCRIPTION)
        command.arguments(options)
        options.set_defaults(func=command.handle)
    return parser
