"""The checks: every name a comparison or a divergence is noted under,
declared once with what it compares, whether it is parity or hygiene, and
how a divergence of it gates.

The runners note comparisons under these names (``ScheduleResult.note``);
the policy (``reports/policy.py``), the verdicts and the reports read this
table. Which checks a level requires as evidence is the level's own
declaration (``suites/format/levels.py``). A new check is its code in a runner plus
one constant and one row here.
"""

from dataclasses import dataclass
from typing import Dict

# What a check is about.
PARITY = "parity"  # what a request can observe: the batch against the request run alone
HYGIENE = "hygiene"  # what no request can observe: reported, gating only under a strict policy

# How a divergence of a check gates (``Policy.gates`` applies it).
ALWAYS = "always"  # data movement or structure: never a matter of numerics
BY_TIER = "by the logit tier"  # L2: the row's logit tier against the policy's gate, not one by one
MODEL_WRITTEN = "always at L1; at L2 as the policy's cache_bytes says"  # bytes a model's layer wrote
BY_HYGIENE_POLICY = "as the policy's hygiene says (strict: gates)"  # what no request can observe


@dataclass(frozen=True)
class Check:
    kind: str  # PARITY or HYGIENE
    compares: str  # what holding means, in words
    gates: str = ALWAYS  # ALWAYS, BY_TIER, MODEL_WRITTEN or BY_HYGIENE_POLICY
    # The protocol member whose own output it reads, which its divergences
    # blame by construction (L1); empty: the call after which it was seen.
    reads: str = ""


BYTES = "bytes"
OFFSET = "offset"
LEFT_PADDING = "left_padding"
LAYOUT = "layout"
EXTRACT = "extract"
MASK = "mask"
SHARED_PADDING = "shared_padding"
SOURCE = "source"
NBYTES = "nbytes"
TRIMMED = "trimmed"
RAISED = "raised"
LOGITS = "logits"
TOKENS = "tokens"
LOGPROBS = "logprobs"
LENGTH = "length"
PAD = "pad"
ALIAS = "alias"
STORED = "stored"
STORED_NBYTES = "stored_nbytes"
QUANTIZED = "quantized"
ALONE = "alone"
KV_APPLIED = "kv_applied"
TEXT = "text"

# Every check, in the order the reports list them.
CHECKS: Dict[str, Check] = {
    BYTES: Check(PARITY, "keys and values (packed, scales, biases) equal mlx-lm's solo cache, bit for bit",
                 MODEL_WRITTEN),
    OFFSET: Check(PARITY, "each row's offset (its RoPE position) equals the solo offset", MODEL_WRITTEN),
    LEFT_PADDING: Check(PARITY, "size() minus the row's left padding is the row's length"),
    LAYOUT: Check(PARITY, "the state holds (packed, scales, biases) triples of the expected dtypes and shapes"),
    EXTRACT: Check(PARITY, "extract(i) returns the row as a quantized cache of its offset, bits and group size, "
                           "and leaves the batch unchanged", reads="extract"),
    MASK: Check(PARITY, "make_mask hides exactly the padding and the future", reads="make_mask"),
    SHARED_PADDING: Check(PARITY, "no column is padding in every row"),
    SOURCE: Check(PARITY, "merge and extend leave their sources' bytes unchanged"),
    NBYTES: Check(PARITY, "nbytes counts at least the bytes the rows' columns occupy", reads="nbytes"),
    # Parity: mlx-lm's trim_prompt_cache adds up what trim returns, and a caller
    # that trims by what is left (a prompt cache trimmed to a prefix) reads it.
    TRIMMED: Check(PARITY, "trim returns the count mlx-lm's QuantizedKVCache.trim returns for each row's same trim",
                   reads="trim"),
    RAISED: Check(PARITY, "a member or the engine raised: nothing after it was compared"),
    LOGITS: Check(PARITY, "each row's logits equal (or reach the policy's tier of) the request run alone", BY_TIER),
    TOKENS: Check(PARITY, "greedy (L2) or generated (L3, L4) tokens equal the request run alone", BY_TIER),
    LOGPROBS: Check(PARITY, "L3, L4: the log-probabilities of each generated token"),
    LENGTH: Check(PARITY, "L3, L4: how many tokens each request generated"),
    # A stored entry is the row extract returned: its bytes, its nbytes, its
    # trim and its copy are that row's (mlx-lm's store calls them).
    STORED: Check(PARITY, "a stored prompt cache keeps its bytes from its store on, and a join from the store "
                          "starts from the prefix, and the bytes, mlx-lm's store holding the same entries gives",
                  reads="extract"),
    # Parity: the store's byte budget sums it (LRUPromptCache.insert_cache), so
    # a wrong count changes which stored prefixes later requests find.
    STORED_NBYTES: Check(PARITY, "nbytes of a stored prompt cache equals the bytes of its arrays", reads="extract"),
    QUANTIZED: Check(PARITY, "the batch is quantized at the rows' bits and group size: L1, its bits and group_size "
                             "after every call; L3, after the engine's first step that generated a token, every "
                             "layer's cache holds (packed, scales, biases) triples of the requested bits and group "
                             "size"),
    ALONE: Check(PARITY, "L4: a request served among others gets the tokens and log-probs the same server gives "
                         "it alone"),
    KV_APPLIED: Check(PARITY, "L4: a server that declares quantized KV answers as mlx-lm's kv_bits run, where "
                              "that run and the dense one differ, not as the dense one"),
    TEXT: Check(PARITY, "L4: a streamed answer that carries no per-token ids and log-probs: its text equals the "
                        "text mlx-lm's detokenizer makes of the solo run's tokens, and the text served alone"),
    PAD: Check(HYGIENE, "hygiene: pad columns are zero", BY_HYGIENE_POLICY),
    ALIAS: Check(HYGIENE, "hygiene: no memory shared between the batch, its sources and extracted rows",
                 BY_HYGIENE_POLICY),
}
# What the model returns, rather than what the cache holds: a wrong cache shows
# here after the fact, so these checks say that something broke, not which tensor.
OUTPUT_CHECKS = (LOGITS, TOKENS, LOGPROBS, LENGTH)
HYGIENE_CHECKS = tuple(name for name, check in CHECKS.items() if check.kind == HYGIENE)
