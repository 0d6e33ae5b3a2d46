"""The parser of ``kvparity``, assembled from the commands, one module
each: its name, help, arguments and handler. ``kvparity.reports.cli`` runs
it and turns what a handler returns or raises into the exit status. A new
command is its module plus one entry in ``COMMANDS``."""

import argparse
import sys

from kvparity.oracle.models import available_models
from kvparity.reports.commands import (
    bench, bisect, calibrate, check, compare, coverage, fuzz, matrix, merge, model_dir, models, mutate, probe, record,
    replay, run, vectors,
)
from kvparity.reports.verdicts import EXIT_USAGE

COMMANDS = (run, bench, check, merge, matrix, replay, bisect, fuzz, mutate, models, model_dir, probe, record,
            calibrate, compare, coverage, vectors)

EXAMPLES = """examples:
  kvparity run                                   the catalog against the reference cache
  kvparity run --impl myserver.cache:BatchCache  ... against your implementation
  kvparity run --model smollm2                   L2 on the real SmolLM2-135M
  kvparity replay found.json --level L1          one schedule, row by row
  kvparity fuzz --workers 2 --minutes 10         generated schedules, shrunk failures
  kvparity vectors export vectors/               the L1 catalog as data any test runner reads
  kvparity mutate --workers 4                    your cache's lines the gate does not constrain
  kvparity coverage                              the cells of the coverage model the catalog reaches
  git bisect run kvparity check                  find the commit that broke parity (impl from
                                                 [tool.kvparity] of pyproject.toml, or --impl)
  kvparity check --shard 1/2 --out s1; kvparity check --shard 2/2 --out s2; kvparity merge s1 s2
                                                 one verdict from two machines

models: {models}

exit status: 0 parity holds, 1 parity broken, 125 cannot judge here (git bisect run skips
the commit); above 127 git bisect run aborts: 128 the harness itself failed, 129 usage
error, 130 interrupted

settings: each option named in [tool.kvparity] of pyproject.toml (impl, levels, engine,
model, device, policy, expectations) is read from there when not given; the
implementation under test has no default
"""


class Parser(argparse.ArgumentParser):
    """argparse, its usage errors exiting as kvparity's do (EXIT_USAGE, which
    aborts git bisect run), not with argparse's 2, which git reads as "bad"."""

    def error(self, message):
        self.print_usage(sys.stderr)
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
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
        # The settings it reads (reports/settings.py), resolved by cli.main before the handler runs.
        options.set_defaults(func=command.handle, reads_settings=getattr(command, "SETTINGS", ()),
                             requires_settings=getattr(command, "REQUIRED", ()))
    return parser
