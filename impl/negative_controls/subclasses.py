"""Classes that behave differently when subclassed: they hold kvparity to
running the class a user ships as itself."""

from kvparity.impl.batch_quantized import BatchQuantizedKVCache

from kvparity.impl.negative_controls.members import _zero_first_token, MaskIgnoresLeftPadding


# A verdict is about the class a user ships, so the harness never runs a
# subclass of it. Each names the outcome a run of the catalog must reach;
# a broken one also names the check that catches it.


class BreaksItsSubclasses(BatchQuantizedKVCache):
    """Correct as shipped. Its ``__init_subclass__`` resets a class flag, as
    a published cache's does: a subclass is taken to own the buffers its
    merge consumed, so its merge writes into its sources in place. A harness
    that ran a subclass of it would see ``source`` break."""

    expected_outcome = "pass"
    owns_its_sources = False

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        cls.owns_its_sources = True

    @classmethod
    def merge(cls, caches):
        batch = super().merge(caches)
        if cls.owns_its_sources:
            _zero_first_token(caches)
        return batch


class ChecksItsOwnType(BatchQuantizedKVCache):
    """Correct as shipped. Its members check ``type(self) is`` their class,
    as code that dispatches on exact types does, and raise for anything
    else: a harness that ran a subclass of it would see every member raise."""

    expected_outcome = "pass"

    @classmethod
    def merge(cls, caches):
        _exactly_this(cls)
        return super().merge(caches)

    def extend(self, other):
        _exactly_this(type(self))
        _exactly_this(type(other))
        super().extend(other)

    def update_and_fetch(self, keys, values):
        _exactly_this(type(self))
        return super().update_and_fetch(keys, values)

    def make_mask(self, N, return_array=False, window_size=None, **kwargs):
        _exactly_this(type(self))
        return super().make_mask(N, return_array=return_array, window_size=window_size, **kwargs)


def _exactly_this(cls):
    if cls is not ChecksItsOwnType:
        raise TypeError(f"{cls.__name__} is not ChecksItsOwnType")


class MaskRightOnlyInSubclasses(BatchQuantizedKVCache):
    """Broken as shipped: make_mask lets rows attend to their pad columns
    (as ``MaskIgnoresLeftPadding``) unless the class is a subclass, whose
    ``__init_subclass__`` turns the padding mask on. A harness that ran a
    subclass of it would pass it."""

    expected_outcome = "FAIL"
    caught_by = "mask"
    masks_padding = False

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        cls.masks_padding = True

    def make_mask(self, N, return_array=False, window_size=None, **kwargs):
        if self.masks_padding:
            return super().make_mask(N, return_array=return_array, window_size=window_size, **kwargs)
        return MaskIgnoresLeftPadding.make_mask(self, N, return_array, window_size)


SUBCLASS_SENSITIVE = [BreaksItsSubclasses, ChecksItsOwnType, MaskRightOnlyInSubclasses]
