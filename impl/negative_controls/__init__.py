"""Broken variants of the reference cache: each must be caught by the gate.

Every class breaks one thing a real implementation gets wrong, and names the
check expected to catch it. ``test_negative_controls.py`` runs the catalog on
each and fails if any survives. They are valid ``--impl`` targets by this
package's name, e.g.
``kvparity run --impl kvparity.impl.negative_controls:MaskIgnoresLeftPadding``.

A module per kind: ``members`` (one member broken as real caches break it),
``at_fault`` (one failure group naming its member), ``boundary`` (right at
every value but one edge), ``stored`` (caught only through a stored row),
``vacuity`` (passing without evidence), ``hangs`` (a member that never
returns), ``designed`` (a difference on purpose), ``subclasses`` (classes
that behave differently when subclassed, which hold the harness to running
the class a user ships as itself).
"""

from kvparity.impl.negative_controls.members import (
    LeftPaddingOffByOne,
    FilterKeepsSharedPadding,
    ExtractReturnsViews,
    RollbackByLargest,
    MergeRequantizes,
    MergeWritesItsSources,
    ExtractWritesTheBatch,
    MaskIgnoresLeftPadding,
    ExtendForgetsExistingPadding,
    RopeOffsetIgnoresLeftPadding,
    TrimForgetsOffset,
    FinalizeLeavesJunk,
    GrowthDropsTail,
    EmptyBatchPacksWholeElementsPerWord,
    FilterSharedPaddingOffByOne,
    FilterKeepsAMarginColumn,
    TrimSlicesOnlyPackedWords,
    EmptyBatchSizesValuesLikeKeys,
)
from kvparity.impl.negative_controls.at_fault import (
    MaskUnmaskedForOneToken,
    MergeOfEmptyRowsTakesDefaults,
    TrimReleasesStepsRoundingDown,
    ExtractDescribes8BitRowsAtGroup64,
)
from kvparity.impl.negative_controls.boundary import (
    BOUNDARY,
    PrepareRightPaddingPastOne,
    FilterDropsSharedPaddingFromTwo,
    RollbackRefusesToEmptyARow,
    ExtendPadsNoEmptySide,
    TrimCountsWhatRemains,
    NbytesZeroWithoutTokens,
    MergePadsNoFreshRow,
    ExtendPadsNoEmptyJoiners,
    MergeStopsAtAFreshRow,
    SaysUntrimmable,
)
from kvparity.impl.negative_controls.stored import (
    StoredNbytesSkipsBiases,
    ExtractLendsItsColumns,
    StoredRowTrimForgetsScales,
    StoredNbytesCountsPacked,
    StoredCopySharesBuffers,
    STORE_VARIANTS,
)
from kvparity.impl.negative_controls.vacuity import (
    RefusesUpdateAndFetch,
    ZeroesMergeRefusesFilter,
    StateReturnsNone,
    ZeroWidthState,
    WithoutPerRowRollback,
    RollbackRaisesNotImplemented,
    VACUITY,
)
from kvparity.impl.negative_controls.hangs import FilterNeverReturns, HANGS
from kvparity.impl.negative_controls.designed import (
    ExtractReturnsBfloat16,
    ExtractReturnsBfloat16TrimForgetsOffset,
)
from kvparity.impl.negative_controls.subclasses import (
    BreaksItsSubclasses,
    ChecksItsOwnType,
    MaskRightOnlyInSubclasses,
    SUBCLASS_SENSITIVE,
)


VARIANTS = [
    LeftPaddingOffByOne,
    FilterKeepsSharedPadding,
    ExtractReturnsViews,
    RollbackByLargest,
    MergeRequantizes,
    MergeWritesItsSources,
    ExtractWritesTheBatch,
    MaskIgnoresLeftPadding,
    ExtendForgetsExistingPadding,
    RopeOffsetIgnoresLeftPadding,
    TrimForgetsOffset,
    FinalizeLeavesJunk,
    GrowthDropsTail,
    EmptyBatchPacksWholeElementsPerWord,
    FilterSharedPaddingOffByOne,
    FilterKeepsAMarginColumn,
    TrimSlicesOnlyPackedWords,
    EmptyBatchSizesValuesLikeKeys,
    MaskUnmaskedForOneToken,
    MergeOfEmptyRowsTakesDefaults,
    TrimReleasesStepsRoundingDown,
    ExtractDescribes8BitRowsAtGroup64,
] + BOUNDARY
# One failure group each, naming its ``at_fault``: the two the groups were first built on, and five others.
AT_FAULT = [FilterSharedPaddingOffByOne, TrimSlicesOnlyPackedWords, MaskUnmaskedForOneToken,
            MergeOfEmptyRowsTakesDefaults, TrimReleasesStepsRoundingDown, ExtractDescribes8BitRowsAtGroup64,
            StoredNbytesSkipsBiases]

__all__ = [
    "LeftPaddingOffByOne",
    "FilterKeepsSharedPadding",
    "ExtractReturnsViews",
    "RollbackByLargest",
    "MergeRequantizes",
    "MergeWritesItsSources",
    "ExtractWritesTheBatch",
    "MaskIgnoresLeftPadding",
    "ExtendForgetsExistingPadding",
    "RopeOffsetIgnoresLeftPadding",
    "TrimForgetsOffset",
    "FinalizeLeavesJunk",
    "GrowthDropsTail",
    "EmptyBatchPacksWholeElementsPerWord",
    "FilterSharedPaddingOffByOne",
    "FilterKeepsAMarginColumn",
    "TrimSlicesOnlyPackedWords",
    "EmptyBatchSizesValuesLikeKeys",
    "MaskUnmaskedForOneToken",
    "MergeOfEmptyRowsTakesDefaults",
    "TrimReleasesStepsRoundingDown",
    "ExtractDescribes8BitRowsAtGroup64",
    "BOUNDARY",
    "PrepareRightPaddingPastOne",
    "FilterDropsSharedPaddingFromTwo",
    "RollbackRefusesToEmptyARow",
    "ExtendPadsNoEmptySide",
    "TrimCountsWhatRemains",
    "NbytesZeroWithoutTokens",
    "MergePadsNoFreshRow",
    "ExtendPadsNoEmptyJoiners",
    "MergeStopsAtAFreshRow",
    "SaysUntrimmable",
    "StoredNbytesSkipsBiases",
    "ExtractLendsItsColumns",
    "StoredRowTrimForgetsScales",
    "StoredNbytesCountsPacked",
    "StoredCopySharesBuffers",
    "STORE_VARIANTS",
    "RefusesUpdateAndFetch",
    "ZeroesMergeRefusesFilter",
    "StateReturnsNone",
    "ZeroWidthState",
    "WithoutPerRowRollback",
    "RollbackRaisesNotImplemented",
    "VACUITY",
    "FilterNeverReturns",
    "HANGS",
    "ExtractReturnsBfloat16",
    "ExtractReturnsBfloat16TrimForgetsOffset",
    "BreaksItsSubclasses",
    "ChecksItsOwnType",
    "MaskRightOnlyInSubclasses",
    "SUBCLASS_SENSITIVE",
    "VARIANTS",
    "AT_FAULT",
]
