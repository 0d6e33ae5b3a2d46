"""``kvparity models``: every model kvparity runs, with its per-layer cache
plan and whether mlx-lm's solo kv_bits run exists on it."""

import json

from tabulate import tabulate

from kvparity.oracle.mlx_lm_versions import defect_for_model
from kvparity.oracle.models import available_models
from kvparity.reports.commands.base import UsageError, load_model
from kvparity.reports.verdicts import EXIT_OK

NAME = "models"
HELP = "list the models (random, mlx-lm's architectures, the real one) and each one's per-layer cache plan"
DESCRIPTION = ("For each model: what each layer of mlx-lm's prompt cache holds (Q(heads x dims): a layer "
               "mlx-lm quantizes, batched by the cache under test; a class name: mlx-lm's own, batched by "
               "mlx-lm), and whether mlx-lm's solo kv_bits run, the oracle, exists on it (else the mlx-lm "
               "limit or defect that keeps it from being judged, found by running mlx-lm).")


def arguments(command):
    command.add_argument("names", nargs="*", metavar="NAME", help="these models only (default: every one)")
    command.add_argument("--json", action="store_true", help="one JSON document instead of a table")


def model_record(name: str) -> dict:
    loaded = load_model(name)
    limit = defect_for_model(loaded)
    return {
        "model": name,
        "layers": [{"index": layer.index, "cache": layer.cache, "quantized": layer.quantized,
                    "key_dim": layer.key_dim, "value_dim": layer.value_dim, "kv_heads": layer.kv_heads,
                    "trimmable": layer.trimmable, "batched": layer.batched or None} for layer in loaded.plan.layers],
        "plan": loaded.plan.summary(),
        "solo_kv_bits": "runs" if limit is None else limit.name,
        "limit": None if limit is None else limit.attribution(),
    }


def handle(args):
    names = args.names or available_models()
    unknown = [n for n in names if n not in available_models()]
    if unknown:
        raise UsageError(f"unknown model {unknown[0]!r} (available: {', '.join(available_models())})")
    records = [model_record(name) for name in names]
    if args.json:
        print(json.dumps({"models": records}, indent=1))
        return EXIT_OK
    rows = [(r["model"], r["plan"], "yes" if r["limit"] is None else "no",
             "" if r["limit"] is None else f"{r['solo_kv_bits']}: {r['limit']}") for r in records]
    print(tabulate(rows, ("model", "layers (Q: quantized, heads x dims)", "judged", "mlx-lm's limit"),
                   tablefmt="simple", maxcolwidths=[None, 40, None, 80]))
    return EXIT_OK
