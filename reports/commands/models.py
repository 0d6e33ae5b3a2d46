"""``kvparity models``: every model kvparity runs, with its per-layer cache
plan and whether mlx-lm's solo kv_bits run exists on it; with ``--all``,
every architecture module the installed mlx-lm has."""

import json
from pathlib import Path

from tabulate import tabulate

from kvparity.oracle.mlx_lm_versions import defect_for_model
from kvparity.oracle.models import available_models
from kvparity.oracle.zoo import PublishedIndex, architecture_modules, known_configs, mlx_lm_modules
from kvparity.reports.commands.base import CannotRun, check_model_name, load_model_or_refuse
from kvparity.reports.verdicts import EXIT_OK

NAME = "models"
HELP = "list the models (random, mlx-lm's architectures, the real one) and each one's per-layer cache plan"
DESCRIPTION = ("For each model: what each layer of mlx-lm's prompt cache holds (Q(heads x dims): a layer "
               "mlx-lm quantizes, batched by the cache under test; a class name: mlx-lm's own, batched by "
               "mlx-lm), and whether mlx-lm's solo kv_bits run, the oracle, exists on it (else the mlx-lm "
               "limit or defect that keeps it from being judged, found by running mlx-lm, or the model's own "
               "fact: every layer recurrent state, a head dim no MLX group size divides). A NAME may be a model "
               "directory or a config.json. With --all, every module of the installed mlx-lm: its plan where "
               "kvparity has a config for it (the zoo's, or a published config.json, with the public checkpoint "
               "its values are from), else the reason it has none in words (not a language model, no twin), else "
               "\"pass your config.json\" (kvparity check --model CONFIG.json judges a tiny random twin of it).")
PASS_CONFIG = "pass your config.json"


def arguments(command):
    command.add_argument("names", nargs="*", metavar="NAME", help="these models only (default: every one)")
    command.add_argument("--json", action="store_true", help="one JSON document instead of a table")
    command.add_argument("--all", action="store_true",
                         help="every module of the installed mlx-lm: its plan, or the reason it has none")


NOTHING_TO_JUDGE = "nothing-to-judge"  # what "solo_kv_bits" says where the model itself leaves nothing to judge


def model_record(name: str) -> dict:
    loaded = load_model_or_refuse(name)
    why = loaded.plan.nothing_to_judge()  # the model's own fact, before any limit of mlx-lm's
    limit = None if why else defect_for_model(loaded)
    return {
        "model": name,
        "layers": [{"index": layer.index, "cache": layer.cache, "quantized": layer.quantized,
                    "key_dim": layer.key_dim, "value_dim": layer.value_dim, "kv_heads": layer.kv_heads,
                    "trimmable": layer.trimmable, "batched": layer.batched or None} for layer in loaded.plan.layers],
        "plan": loaded.plan.summary(),
        "solo_kv_bits": NOTHING_TO_JUDGE if why else "runs" if limit is None else limit.name,
        "limit": why or (None if limit is None else limit.attribution()),
    }


CANNOT_RUN_HERE = "cannot-run-here"  # what "solo_kv_bits" says where mlx-lm cannot run the model on this machine


def known_record(module: str, name: str) -> dict:
    """A module's record from its known config; one mlx-lm cannot run here (a
    Metal kernel on CPU) says why in its row rather than ending the list."""
    try:
        return {"module": module, **model_record(name)}
    except CannotRun as error:
        return {"module": module, "model": name, "layers": [], "plan": "-", "solo_kv_bits": CANNOT_RUN_HERE,
                "limit": str(error)}


def module_records() -> list:
    """One record per module of the installed mlx-lm (``--all``): a model module's
    plan where kvparity has a config for it, else the reason it has none."""
    known, index = known_configs(), PublishedIndex.read()
    architectures = set(architecture_modules())
    records = []
    for module in mlx_lm_modules():
        if module not in architectures and module not in index.without_config:
            continue  # a helper a later mlx-lm added: no model, nothing to judge
        if module in known:
            checkpoint = index.checkpoints.get(Path(known[module]).stem) if known[module].endswith(".json") else None
            records.append({**known_record(module, known[module]), "checkpoint": checkpoint})
        else:
            records.append({"module": module, "model": None, "plan": index.without_config.get(module, PASS_CONFIG),
                            "solo_kv_bits": None, "limit": None})
    return records


def handle(args, settings):
    for name in args.names:
        check_model_name(name, "NAME")
    if args.all:
        records = module_records()
    else:
        records = [model_record(name) for name in args.names or available_models()]
    if args.json:
        print(json.dumps({"models": records}, indent=1))
        return EXIT_OK
    rows = [(r["model"], r["plan"], "-" if r["model"] is None else "yes" if r["limit"] is None else "no",
             "" if r["limit"] is None else f"{r['solo_kv_bits']}: {r['limit']}") for r in records]
    headers = ("model", "layers (Q: quantized, heads x dims)", "judged", "mlx-lm's limit")
    if args.all:
        rows, headers = [(r["module"], *row) for r, row in zip(records, rows)], ("mlx-lm module", *headers)
    print(tabulate(rows, headers, tablefmt="simple", maxcolwidths=[None] * (len(headers) - 3) + [40, None, 80]))
    return EXIT_OK
