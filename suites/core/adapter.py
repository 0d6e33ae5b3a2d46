"""How an implementation under test is plugged in, and watched.

An implementation is named ``package.module:attribute``. The attribute is
either a batch cache class or a zero-argument factory returning one. The class
follows mlx-lm's batch cache protocol over quantized triples:

* ``merge(rows)`` classmethod: solo ``QuantizedKVCache`` rows -> batch
* ``extend(other)``, ``filter(indices)``, ``extract(i)``, ``trim(n)``
* ``update_and_fetch(keys, values)``, ``make_mask(N, ...)``
* ``prepare(...)``/``finalize()``, ``size()``, ``offset``, ``left_padding``
* ``state`` whose first two items are the key and value triples
* ``bits``, ``group_size``, ``nbytes``

Optional capabilities are detected on the class, never assumed. The class
runs as itself: ``type(batch)`` is the user's class and no subclass is ever
made (a class may treat its subclasses differently). For the duration of a
run, ``Implementation.watching`` installs wrappers in the class's own
namespace that count every call of a protocol member (the evidence that the
member was exercised) and tag what a member raises with its name; afterwards
the namespace is exactly as it was, also when the run raised or was
interrupted. Bases are never touched. ``NotImplementedError`` from an
optional member means "not supported"; from a required member it is a
refusal, a failure.
"""

import functools
import importlib
import importlib.abc
import importlib.util
import inspect
import json
import os
import sys
import weakref
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional

from kvparity.suites.core.flight import FLIGHT, MemberHung
from kvparity.suites.core.process_cache import EXEC, command_of, process_batch_class

from kvparity.suites.core.members import REQUIRED_MEMBERS, CAPABILITIES, OPTIONAL_MEMBERS, CHANGING_MEMBERS
from kvparity.suites.core.raised import ImplementationError, ImplementationUnavailable, MemberRaised, HungEarlier


REFERENCE = "kvparity.impl.batch_quantized:BatchQuantizedKVCache"


_ABSENT = object()  # a name the class did not define itself


@contextmanager
def patched(cls: type, attributes: Dict[str, object]):
    """``cls`` with ``attributes`` set in its own namespace while the block
    runs. Afterwards each name holds the very object it held before, or is
    deleted again where the class inherited it (a base is never written).
    ``type.__setattr__`` bypasses any hook a metaclass puts on setting."""
    saved = {}
    try:
        for name, value in attributes.items():
            saved[name] = cls.__dict__.get(name, _ABSENT)
            type.__setattr__(cls, name, value)
        yield
    finally:
        for name, before in saved.items():
            if before is not _ABSENT:
                type.__setattr__(cls, name, before)
            elif name in cls.__dict__:
                type.__delattr__(cls, name)


class _Watch:
    """The wrappers on one class while runs watch it, and the call counters
    of those runs. A run inside a run shares the wrappers; a counter already
    counting (the same implementation watching again) counts a call once.
    A trail lists, in order, the calls made from outside the class (a member
    calling another is one call of the first)."""

    def __init__(self):
        self.counters: List[Counter] = []  # what the wrappers add to
        self.trails: List[list] = []  # the members called from outside, in order
        self.depth = 0  # members of the class running now, one inside another
        self.outside_calls = 0  # calls from outside the class so far, over every run

    @contextmanager
    def counting(self, calls: Counter, trail: list):
        first = all(c is not calls for c in self.counters)
        if first:
            self.counters, self.trails = self.counters + [calls], self.trails + [trail]
        try:
            yield
        finally:
            if first:
                self.counters = [c for c in self.counters if c is not calls]
                self.trails = [t for t in self.trails if t is not trail]

    def member(self, name: str, fn: Callable) -> Callable:
        fn = getattr(fn, "_watched_original", fn)  # a base being watched too: wrap its own code

        @functools.wraps(fn)
        def member(*args, **kwargs):
            if name in FLIGHT.hung:  # it hung before: calling it again would cost the timeout again
                raise HungEarlier(name, FLIGHT.hung[name])
            for counter in self.counters:
                counter[name] += 1
            if not self.depth:
                self.outside_calls += 1
                for trail in self.trails:
                    trail.append(name)
                FLIGHT.member(name)
                if name in CHANGING_MEMBERS:
                    FLIGHT.last_change = name
            self.depth += 1
            try:
                return fn(*args, **kwargs)
            except MemberRaised:
                raise
            except Exception as error:
                if isinstance(error, MemberHung):  # a cache process stopped at the timeout: never waited on again
                    FLIGHT.hung_here(name)
                raised = MemberRaised(name, error)
                raised.handed = args[1:], kwargs  # what the caller gave it (after self or cls)
                raise raised from error
            finally:
                self.depth -= 1
                if not self.depth:
                    FLIGHT.member(None)

        member._watched_original = fn
        return member

    def members(self, batch_class: type) -> Dict[str, object]:
        """The protocol members of ``batch_class``, own or inherited, as
        counting attributes of the same kind."""
        out = {}
        for name in REQUIRED_MEMBERS + tuple(OPTIONAL_MEMBERS):
            try:
                attr = inspect.getattr_static(batch_class, name)
            except AttributeError:
                continue
            if isinstance(attr, classmethod):
                out[name] = classmethod(self.member(name, attr.__func__))
            elif isinstance(attr, staticmethod):
                out[name] = staticmethod(self.member(name, attr.__func__))
            elif isinstance(attr, property):
                out[name] = property(
                    self.member(name, attr.fget) if attr.fget else None,
                    self.member(name, attr.fset) if attr.fset else None,
                    attr.fdel,
                    attr.__doc__,
                )
            elif inspect.isfunction(attr):
                out[name] = self.member(name, attr)
        return out


_WATCHES: Dict[type, _Watch] = {}  # class -> its watch, while a run watches it
# class -> (what its protocol names held, a watch, that watch's wrappers): a
# generated schedule watches once per event, so the wrappers are made again
# only when the class or a base changed what a protocol name holds.
_MADE = weakref.WeakKeyDictionary()


def _protocol_attributes(cls: type) -> tuple:
    """What each protocol name holds on ``cls`` or the first base defining it."""
    found = []
    for name in REQUIRED_MEMBERS + tuple(OPTIONAL_MEMBERS):
        found.append(next((klass.__dict__[name] for klass in cls.__mro__ if name in klass.__dict__), _ABSENT))
    return tuple(found)


def _watch_of(cls: type):
    """A watch of ``cls`` with its wrappers, made again only if the class changed."""
    attributes = _protocol_attributes(cls)
    made = _MADE.get(cls)
    if made is None or len(made[0]) != len(attributes) or any(a is not b for a, b in zip(made[0], attributes)):
        watch = _Watch()
        made = _MADE[cls] = (attributes, watch, watch.members(cls))
    return made[1], made[2]


@dataclass
class Implementation:
    spec: str
    batch_class: type
    capabilities: Dict[str, bool] = field(default_factory=dict)
    calls: Counter = field(default_factory=Counter)  # protocol member -> calls, while watching
    trail: list = field(default_factory=list)  # the members called, in order, while watching (emptied after)

    @property
    def name(self) -> str:
        return self.spec

    @property
    def process(self) -> Optional[dict]:
        """The hello of a cache in another process (its name, language,
        version), {} where it gave none; None for a Python class."""
        return (self.batch_class.hello or {}) if self.spec.startswith(EXEC) else None

    @property
    def language(self) -> str:
        """The language the cache is written in: Python, or what its process says."""
        process = self.process
        return "python" if process is None else str(process.get("language") or "unknown")

    def supports(self, capability: str) -> bool:
        return self.capabilities.get(capability, False)

    def missing(self, needs) -> List[str]:
        """The capabilities among ``needs`` this implementation lacks."""
        return [c for c in needs if not self.supports(c)]

    def calls_since(self, before: Dict[str, int]) -> Dict[str, int]:
        """Protocol member -> calls made since ``before`` (a copy of ``calls``)."""
        return {m: n - before.get(m, 0) for m, n in self.calls.items() if n > before.get(m, 0)}

    @contextmanager
    def watching(self):
        """Run the class as itself, its protocol members counted into
        ``calls`` and named in what they raise, until the block ends."""
        cls = self.batch_class
        watch = _WATCHES.get(cls)
        if watch is not None:  # a run inside a run: the wrappers are on already
            with watch.counting(self.calls, self.trail):
                yield
            return
        watch, members = _watch_of(cls)
        with patched(cls, members):
            _WATCHES[cls] = watch
            try:
                with watch.counting(self.calls, self.trail):
                    yield
            finally:
                del _WATCHES[cls]
                self.trail.clear()


def calls_made(batch_class: type) -> Optional[int]:
    """How many protocol members have been called from outside ``batch_class``
    while runs watched it; None while none does. An engine notes it at the end
    of each step, so that a divergence can be set beside the calls around it."""
    watch = _WATCHES.get(batch_class)
    return None if watch is None else watch.outside_calls


def detect_capabilities(batch_class: type) -> Dict[str, bool]:
    return {name: callable(getattr(batch_class, member, None)) for name, (_, member) in CAPABILITIES.items()}


def split_spec(option: str, spec: str):
    """``package.module:attribute`` -> (module, attribute); the shape only, no
    import. ``exec:COMMAND`` (a cache in another process) -> (None, its words)."""
    if spec.startswith(EXEC):
        try:
            return None, command_of(spec)
        except ValueError as error:
            raise ImplementationError(f"{option} {spec!r}: {error}")
    module_name, sep, attribute = spec.partition(":")
    if not sep or not module_name or not attribute:
        raise ImplementationError(f"{option} {spec!r}: expected 'package.module:factory'")
    return module_name, attribute


# kvparity mutate: {module name: file} of the modules whose source a mutant
# replaces, read by each gate it runs. The mutant lives in a copy of the file
# outside the user's tree; the module keeps its name and package, so the rest
# of the user's code imports it (and its relative imports resolve) as before.
MUTANT_ENV = "KVPARITY_MUTANT_SOURCES"


class _MutantSources(importlib.abc.MetaPathFinder):
    """Finds the modules ``MUTANT_ENV`` names in their mutated copies, ahead of every other finder."""

    def __init__(self, sources: Dict[str, str]):
        self.sources = sources

    def find_spec(self, name, path=None, target=None):
        if name not in self.sources:
            return None
        source = Path(self.sources[name])
        package = [str(source.parent)] if source.name == "__init__.py" else None
        return importlib.util.spec_from_file_location(name, source, submodule_search_locations=package)


def use_mutant_sources():
    """Put ``MUTANT_ENV``'s finder first, once per process (no-op without it)."""
    given = os.environ.get(MUTANT_ENV)
    if given and not any(isinstance(f, _MutantSources) for f in sys.meta_path):
        sys.meta_path.insert(0, _MutantSources(json.loads(given)))


def resolve(option: str, spec: str):
    """The object a ``package.module:attribute`` spec names. A module that
    cannot be imported, or whose own code fails, is unavailable here; a
    wrong name is a usage error."""
    module_name, attribute = split_spec(option, spec)
    if module_name is None:
        raise ImplementationError(f"{option} {spec!r}: expected 'package.module:attribute', not a command")
    use_mutant_sources()
    try:
        target = importlib.import_module(module_name)
    except ImportError as error:
        absent = isinstance(error, ModuleNotFoundError) and error.name is not None and (
            module_name == error.name or module_name.startswith(error.name + "."))
        raise ImplementationUnavailable(f"{option} {spec!r}: cannot import {module_name}: {error}",
                                        module_name if absent else None)
    except Exception as error:  # a module whose own code fails: this commit cannot be judged
        raise ImplementationUnavailable(f"{option} {spec!r}: importing {module_name} raised "
                                        f"{type(error).__name__}: {error}")
    for part in attribute.split("."):
        if not hasattr(target, part):
            raise ImplementationError(f"{option} {spec!r}: {module_name} has no {attribute}")
        target = getattr(target, part)
    return target


def load_implementation(spec: str = None) -> Implementation:
    spec = spec or REFERENCE
    if spec.startswith(EXEC):
        return _process_implementation(spec)
    target = resolve("--impl", spec)
    batch_class = target if inspect.isclass(target) else _call_factory(spec, target)
    missing = [m for m in REQUIRED_MEMBERS if not hasattr(batch_class, m)]
    if missing:
        raise ImplementationError(f"--impl {spec!r}: {batch_class.__name__} lacks {', '.join(missing)}")
    return Implementation(spec, batch_class, detect_capabilities(batch_class))


def _call_factory(spec: str, factory: Callable) -> type:
    if not callable(factory):
        raise ImplementationError(f"--impl {spec!r}: not a class or a factory")
    try:
        batch_class = factory()
    except Exception as error:  # the implementation's own code fails: this commit cannot be judged
        raise ImplementationUnavailable(f"--impl {spec!r}: the factory raised {type(error).__name__}: {error}")
    if not inspect.isclass(batch_class):
        raise ImplementationError(
            f"--impl {spec!r}: the factory returned {type(batch_class).__name__}, not a batch cache class"
        )
    return batch_class


def _process_implementation(spec: str) -> Implementation:
    """``exec:COMMAND``: the proxy class of a cache in a process of its own
    (``suites/core/process_cache.py``). A command that cannot be started here
    (no such program) cannot be judged here."""
    split_spec("--impl", spec)
    try:
        batch_class = process_batch_class(spec)
    except OSError as error:
        raise ImplementationUnavailable(f"--impl {spec!r}: cannot start {command_of(spec)[0]}: {error}")
    return Implementation(spec, batch_class, detect_capabilities(batch_class))
