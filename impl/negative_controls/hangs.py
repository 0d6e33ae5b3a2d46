"""A cache with a member that never returns."""

import time

from kvparity.impl.batch_quantized import BatchQuantizedKVCache


# Judged only by the kvparity executable, whose parent stops a member call that
# outruns --member-timeout (suites/core/flight.py); run in process, it would hang its caller.


class FilterNeverReturns(BatchQuantizedKVCache):
    """filter never returns, as a deadlock or a spin in native code would
    not: the cache's FAIL naming filter, one group, in one member timeout
    however many schedule runs call filter (the others are not judged)."""

    at_fault = "filter"

    def filter(self, batch_indices):
        while True:
            time.sleep(3600)


HANGS = [FilterNeverReturns]
