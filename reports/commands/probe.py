"""``kvparity probe``: L0, which backend ops are batch-invariant for a model's shapes."""

import argparse
from typing import Optional

from tabulate import tabulate

from kvparity.oracle.models import DEFAULT_MODEL
from kvparity.oracle.plan import probe_group_size
from kvparity.oracle.probes import ProbeShapes, ProbeUnavailable, probe_notes, probe_table, run_probes
from kvparity.reports.commands.base import (
    DEVICE_HELP, CannotRun, UsageError, check_model_name, model_help, model_or_default, use_device,
)
from kvparity.reports.verdicts import EXIT_OK

NAME = "probe"
HELP = "L0: which backend ops are batch-invariant for a model's shapes"
DESCRIPTION = ("For the model's shapes on the chosen device, check whether each op (matmul, quantized_matmul, "
               "quantize, fast.rope with per-row offsets, quantized SDPA with a left-padding mask) gives row i "
               "of a batch byte-identical to row i alone.")

# The settings it reads (reports/settings.py): the command line, else [tool.kvparity], else the default.
SETTINGS = ("model", "device")
REQUIRED = ()


def batch_sizes(text):
    try:
        sizes = [int(b) for b in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected batch sizes like 1,2,8, got {text!r}")
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"batch sizes must be >= 1, got {text!r}")
    return sizes


def arguments(command):
    command.add_argument("--model", metavar="NAME", help=f"whose shapes (default: {DEFAULT_MODEL}); {model_help()}")
    command.add_argument("--device", choices=("cpu", "gpu"), help=DEVICE_HELP)
    command.add_argument("--batch-sizes", type=batch_sizes, default=[1, 2, 4, 8, 16],
                         metavar="B,B,...", help="batch sizes (default: 1,2,4,8,16)")
    command.add_argument("--kv-bits", type=int, default=4, help="KV bits for the quantized ops (default: 4)")
    command.add_argument("--kv-group-size", type=int, default=64, help="KV group size (default: 64)")


def unprobed(model) -> Optional[str]:
    """Why the model has no attention shapes to probe, or None."""
    if model.plan.nothing_to_judge():
        return model.plan.nothing_to_judge()
    if model.head_dim is None:
        return f"no layer of it keeps keys and values as mlx-lm's KVCache does ({model.plan.summary()})"
    return None


def probes(model, device, batch_sizes=(1, 2, 4, 8, 16), kv_bits=4, kv_group_size=None):
    """L0 for the model's shapes: explains L2 outcomes in the report. The
    group size by default the first of MLX's (64 first) that divides the head
    dim; a model that leaves nothing to judge has no such shapes to probe."""
    why = unprobed(model)
    if why:
        raise CannotRun(f"{model.name}: {why}")
    try:
        shapes = ProbeShapes.from_args(
            hidden_size=model.hidden_size, n_heads=model.n_heads, n_kv_heads=model.n_kv_heads,
            head_dim=model.head_dim, vocab_size=model.vocab_size, dtype=model.dtype,
            kv_bits=kv_bits, kv_group_size=kv_group_size or probe_group_size([model.head_dim]),
        )
    except ValueError as error:
        raise UsageError(f"kvparity probe on {model.name}: {error}")
    try:
        return run_probes(shapes, batch_sizes=batch_sizes, device=device)
    except ProbeUnavailable as error:
        raise CannotRun(str(error))


def handle(args, settings):
    check_model_name(settings.model)
    use_device(settings.device)
    model = model_or_default(settings.model)
    results = probes(model, settings.device, args.batch_sizes, args.kv_bits, args.kv_group_size)
    headers, rows = probe_table(results)
    print(f"L0 batch invariance on {model.name} shapes, {settings.device or 'default device'}: "
          "is row i of a batch byte-identical to the op run on row i alone?")
    print(tabulate(rows, headers, tablefmt="simple"))
    for note in probe_notes(results):
        print(note)
    return EXIT_OK
