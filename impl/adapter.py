"""How an implementation under test is plugged in.

An implementation is named ``package.module:attribute``. The attribute is
either a batch cache class or a zero-argument factory returning one. The class
follows mlx-lm's batch cache protocol over quantized triples:

* ``merge(rows)`` classmethod: solo ``QuantizedKVCache`` rows -> batch
* ``extend(other)``, ``filter(indices)``, ``extract(i)``, ``trim(n)``
* ``update_and_fetch(keys, values)``, ``make_mask(N, ...)``
* ``prepare(...)``/``finalize()``, ``size()``, ``offset``, ``left_padding``
* ``state`` whose first two items are the key and value triples
* ``bits``, ``group_size``, ``nbytes``

Optional capabilities are detected, never assumed; a schedule that needs a
missing one is reported "not supported". Raising ``NotImplementedError``
from any member also means "not supported".
"""

import importlib
import inspect
from dataclasses import dataclass, field
from typing import Callable, Dict

REFERENCE = "kvparity.impl.batch_quantized:BatchQuantizedKVCache"

REQUIRED_MEMBERS = (
    "merge",
    "extend",
    "filter",
    "extract",
    "trim",
    "update_and_fetch",
    "make_mask",
    "prepare",
    "finalize",
    "size",
    "state",
    "nbytes",
)

# capability -> (what it means, how it is detected on the class)
CAPABILITIES: Dict[str, tuple] = {
    "per_row_rollback": (
        "rows keep different counts after a speculative round "
        "(rollback(amounts), re-aligning the rows)",
        lambda cls: callable(getattr(cls, "rollback", None)),
    ),
}


class ImplementationError(Exception):
    """The implementation named on the command line cannot be used."""


@dataclass(frozen=True)
class Implementation:
    spec: str
    batch_class: type
    capabilities: Dict[str, bool] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.spec

    def supports(self, capability: str) -> bool:
        return self.capabilities.get(capability, False)

    def merge(self, rows):
        return self.batch_class.merge(rows)


def detect_capabilities(batch_class: type) -> Dict[str, bool]:
    return {name: bool(test(batch_class)) for name, (_, test) in CAPABILITIES.items()}


def load_implementation(spec: str = None) -> Implementation:
    spec = spec or REFERENCE
    module_name, sep, attribute = spec.partition(":")
    if not sep or not module_name or not attribute:
        raise ImplementationError(
            f"--impl {spec!r}: expected 'package.module:factory'"
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise ImplementationError(f"--impl {spec!r}: cannot import {module_name}: {error}")
    target = module
    for part in attribute.split("."):
        if not hasattr(target, part):
            raise ImplementationError(f"--impl {spec!r}: {module_name} has no {attribute}")
        target = getattr(target, part)
    batch_class = target if inspect.isclass(target) else _call_factory(spec, target)
    missing = [m for m in REQUIRED_MEMBERS if not hasattr(batch_class, m)]
    if missing:
        raise ImplementationError(
            f"--impl {spec!r}: {batch_class.__name__} lacks {', '.join(missing)}"
        )
    return Implementation(spec, batch_class, detect_capabilities(batch_class))


def _call_factory(spec: str, factory: Callable) -> type:
    if not callable(factory):
        raise ImplementationError(f"--impl {spec!r}: not a class or a factory")
    batch_class = factory()
    if not inspect.isclass(batch_class):
        raise ImplementationError(
            f"--impl {spec!r}: the factory returned {type(batch_class).__name__}, "
            "not a batch cache class"
        )
    return batch_class
