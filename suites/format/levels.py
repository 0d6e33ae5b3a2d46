"""The levels a schedule is judged at: what each runs, in one line, and
what a row must have compared at that level to pass.

``reports/verdicts.py`` judges by these declarations; expectations files
name levels from here. A new level is its runner plus one entry.

The runner of each level is bound where the command line assembles its
commands, not here: the runners import ``suites/format/checks.py``, and a level that
imported its runner would tie this module to every model and engine.
"""

from dataclasses import dataclass
from typing import Dict, Tuple

from kvparity.suites.format.checks import ALONE, BYTES, LEFT_PADDING, LOGITS, LOGPROBS, MASK, OFFSET, TOKENS


L1, L2, L3, L4 = "L1", "L2", "L3", "L4"
SCHEDULE, ARRIVALS = "schedule", "arrivals"  # the files a level replays


@dataclass(frozen=True)
class Level:
    name: str
    runs: str  # what it runs, in one line
    requires: Tuple[str, ...]  # checks a row must have compared to pass, in the order a verdict names them
    logit_tiers: bool = False  # rows are judged by their logit tier under the policy, else bit for bit
    every_divergence_gates: bool = False  # no policy relaxes it: every divergence not declared fails its row
    replays: str = SCHEDULE  # its input: schedule files (the catalog's format) or arrivals files
    needs_server: bool = False  # it judges a server over HTTP (--server or --url), not a cache class


LEVELS: Dict[str, Level] = {level.name: level for level in (
    Level(L1, "cache bytes: the schedule replayed on the cache with synthetic keys and values, no model",
          (BYTES, OFFSET, LEFT_PADDING, MASK)),
    Level(L2, "the model per row: batched forwards against each request run alone through mlx-lm",
          (LOGITS, BYTES, OFFSET), logit_tiers=True),
    # Tokens and log-probs bit for bit under every policy: no tiers at L3 yet.
    Level(L3, "a real engine: requests arriving over time, generated tokens against each request alone",
          (TOKENS, LOGPROBS), every_divergence_gates=True, replays=ARRIVALS),
    Level(L4, "a real server over HTTP: concurrent requests against each served alone, mlx-lm's solo run with "
              "the server's declared KV settings, and the dense run",
          (TOKENS, LOGPROBS, ALONE), every_divergence_gates=True, replays=ARRIVALS, needs_server=True),
)}
# What "all levels" runs: every level that judges a cache class; L4 runs when a server is given.
CACHE_LEVELS = tuple(name for name, level in LEVELS.items() if not level.needs_server)
# The levels a schedule file names (and a fuzz campaign generates at).
SCHEDULE_LEVELS = tuple(name for name, level in LEVELS.items() if level.replays == SCHEDULE)
