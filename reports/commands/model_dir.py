"""``kvparity model-dir``: a kvparity model written as a local model directory a server loads."""

from kvparity.oracle.model_dir import write_model_dir
from kvparity.reports.commands.base import check_model_name, load_model_or_refuse, new_path
from kvparity.reports.verdicts import EXIT_OK

NAME = "model-dir"
HELP = "write a model (random, an mlx-lm architecture, SmolLM2) as a local model directory a server loads"
DESCRIPTION = ("Write NAME as a standard local model directory at DIR (new): config.json, model.safetensors "
               "(its parameters as mlx-lm names them, the quantization of a quantized model) and a tokenizer "
               "with a chat template: the model's own (SmolLM2), else a byte-level BPE of words where token i is a "
               "space and a word of letters, so a text of words reads back as their ids whichever tokenizer class "
               "transformers picks for the model type. mlx_lm.load gives back the same parameters, so the directory's logits are the in-memory "
               "model's bit for bit. For servers under test (L4).")

SETTINGS = ()
REQUIRED = ()


def arguments(command):
    command.add_argument("name", metavar="NAME", help="the model (kvparity models lists them)")
    command.add_argument("directory", metavar="DIR", help="the directory to write (it must not exist)")


def handle(args, settings):
    check_model_name(args.name, "NAME")
    new_path(args.directory, "DIR")
    path = write_model_dir(load_model_or_refuse(args.name), args.directory)
    print(f"{args.name}: {path}")
    return EXIT_OK
