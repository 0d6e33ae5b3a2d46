"""A local model directory read as a model like any other (``--model DIR``).

Reading is mlx-lm's own: ``mlx_lm.utils.load_model`` (config.json, the
``model*.safetensors`` files, weight quantization included) and
``load_tokenizer`` (the model's own tokenizer and chat template), so the
model judged is the one ``mlx_lm.load`` gives a server. What it is keys on
the sha256 of its config.json and of its weight files, never on its path.
Its size is read from the safetensors headers before anything is loaded.
"""

import hashlib
import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List

from kvparity.oracle.gguf import sha256_file
from kvparity.oracle.inputs import read_json


class ModelPathError(ValueError):
    """A model given by path that cannot be read: the path, the file and the reason."""


CONFIG = "config.json"
WEIGHT_FILES = "model*.safetensors"  # what mlx_lm.utils.load_model reads


def weight_files(directory: Path) -> List[Path]:
    return sorted(directory.glob(WEIGHT_FILES))


def read_config(directory: Path) -> dict:
    """The directory's config.json, or a clear refusal naming the file."""
    path = directory / CONFIG
    if not path.is_file():
        raise ModelPathError(f"{directory}: not a model directory (no {CONFIG}; expected the layout mlx_lm.load reads)")
    config = read_json(path, ModelPathError)
    if not isinstance(config, dict) or not isinstance(config.get("model_type"), str):
        raise ModelPathError(f"{path}: model_type: missing (mlx-lm picks the architecture by it)")
    return config


@dataclass(frozen=True)
class WeightsSize:
    """What a directory's weight files hold, read from their safetensors headers
    before anything is loaded."""

    parameters: int  # a quantized matrix counts its unpacked elements
    bytes: int  # the tensors' bytes, as loaded


SAFETENSORS_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "U16": 2, "I16": 2, "F16": 2,
                     "BF16": 2, "U32": 4, "I32": 4, "F32": 4, "U64": 8, "I64": 8, "F64": 8}


def safetensors_header(path: Path) -> Dict[str, dict]:
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    header.pop("__metadata__", None)
    return header


def weights_size(directory: Path, config: dict) -> WeightsSize:
    """Parameters and bytes of the weight files; a packed uint32 matrix with
    scales beside it counts 32 / bits elements per word (bits from the
    config's quantization, per layer where it says)."""
    quantization = config.get("quantization") or {}
    parameters = total = 0
    for path in weight_files(directory):
        header = safetensors_header(path)
        for name, tensor in header.items():
            n = 1
            for d in tensor["shape"]:
                n *= d
            total += n * SAFETENSORS_BYTES.get(tensor["dtype"], 4)
            layer = name.rsplit(".", 1)[0]
            if tensor["dtype"] == "U32" and name.endswith(".weight") and f"{layer}.scales" in header:
                bits = (quantization.get(layer) or {}).get("bits", quantization.get("bits", 4))
                n = n * 32 // bits
            elif name.endswith((".scales", ".biases")) and f"{name.rsplit('.', 1)[0]}.weight" in header:
                n = 0  # the quantization's own, not the model's parameters
            parameters += n
    return WeightsSize(parameters, total)


def weights_sha256(directory: Path) -> str:
    """sha256 over the weight files, each as its name and its bytes' sha256, in name order."""
    h = hashlib.sha256()
    for path in weight_files(directory):
        h.update(f"{path.name}|{sha256_file(path)}|".encode())
    return h.hexdigest()


def read_model_dir(directory: Path):
    """(model, config, tokenizer, source) of a local model directory, loaded by
    mlx-lm's own functions; ``source`` is the path and the sha256 of the
    config and of the weights, which ``sha256`` (the solo-run cache's key)
    is made of."""
    from mlx_lm.utils import load_model, load_tokenizer

    read_config(directory)
    if not weight_files(directory):
        raise ModelPathError(f"{directory}: no weights ({WEIGHT_FILES}; mlx_lm.load reads safetensors)")
    try:
        model, config = load_model(directory)
    except (ValueError, KeyError, TypeError, FileNotFoundError) as error:
        raise ModelPathError(f"{directory}: mlx-lm cannot load it: {type(error).__name__}: {error}")
    try:
        tokenizer = load_tokenizer(directory)
    except Exception as error:  # transformers' own errors: any is the directory's
        raise ModelPathError(f"{directory}: mlx-lm cannot load its tokenizer: {type(error).__name__}: {error}")
    config_sha = sha256_file(directory / CONFIG)
    weights_sha = weights_sha256(directory)
    sha = hashlib.sha256(f"config {config_sha}\nweights {weights_sha}\n".encode()).hexdigest()
    return model, config, tokenizer, {"sha256": sha, "path": directory, "config_sha256": config_sha,
                                      "weights_sha256": weights_sha}
