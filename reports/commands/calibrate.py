"""``kvparity calibrate``: how far batched logits move from solo ones on this device, and a proposed kl tier."""

import json
from pathlib import Path

from kvparity.reports.commands.base import DEVICE_HELP, UsageError, use_device, writable_directory
from kvparity.reports.verdicts import EXIT_OK
from kvparity.suites.calibration.run import BATCH_SIZES, PHASES, calibrate

NAME = "calibrate"
HELP = "measure batched-vs-solo logit distances on this device and propose GPU policy thresholds"
DESCRIPTION = ("Sweep batch sizes 1-16 and batch compositions of the reference against mlx-lm's own solo path on "
               "this device, measure the RoPE and mask negative controls, and propose a kl tier with its margin, "
               "or none where no setting qualifies.")

# The settings it reads (reports/settings.py): the command line, else [tool.kvparity], else the default.
SETTINGS = ("device",)
REQUIRED = ()


def arguments(command):
    command.add_argument("--out", required=True, metavar="FILE", help="JSON file to write (rewritten after each phase)")
    command.add_argument("--device", choices=("cpu", "gpu"), help=DEVICE_HELP)
    command.add_argument("--deadline", type=float, default=600, metavar="SECONDS",
                         help="seconds for the whole run (default 600); phases stop at their share of it")
    command.add_argument("--phases", default=",".join(PHASES),
                         help=f"comma-separated subset of {','.join(PHASES)} (default: all)")
    command.add_argument("--models", dest="random_models",  # not the run commands' architecture axis
                         help="comma-separated random models, '-mha' variants allowed (default: all)")
    command.add_argument("--batch-sizes", default=",".join(map(str, BATCH_SIZES)),
                         help="batch sizes of the sweep (default 1-16)")
    command.add_argument("--settings", type=int, default=6, help="how many runnable settings to sweep (default 6)")
    command.add_argument("--compositions", type=int, default=24, help="batch compositions per setting (default 24)")
    command.add_argument("--margin", type=float, default=10.0,
                         help="tau = largest KL observed times this, rounded up (default 10)")
    command.add_argument("--resume", metavar="FILE", help="a JSON file of an earlier run: keep its phases")


def handle(args, settings):
    use_device(settings.device)
    writable_directory(Path(args.out).parent, "--out")
    try:
        data = calibrate(args.out, device=settings.device, deadline=args.deadline, phases=args.phases.split(","),
                         models=args.random_models.split(",") if args.random_models else None,
                         batch_sizes=[int(b) for b in args.batch_sizes.split(",")], settings=args.settings,
                         compositions=args.compositions, margin=args.margin, resume=args.resume)
    except ValueError as error:
        raise UsageError(str(error))
    print(json.dumps(data["proposal"], indent=1))
    return EXIT_OK
