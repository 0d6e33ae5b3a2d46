"""The benchmark ratio table: ratios of two variants measured in one run."""

import json

from kvparity.reports.bench import ratio_table


def bench(case, variant, median, ratios=(), metric="join", **extra):
    return {
        "name": f"{metric}[{case}-{variant}]",
        "stats": {"median": median},
        "extra_info": {"metric": metric, "case": case, "variant": variant, "ratios": list(ratios), **extra},
    }


JOIN = {"name": "join: re-merge / extend time", "numerator": "remerge", "denominator": "extend",
        "quantity": "time", "target": [">=", 3.0]}
MEMORY = {"name": "memory: quantized / bf16 bytes per token", "numerator": "quantized",
          "denominator": "bf16", "quantity": "bytes_per_token", "target": ["<=", 0.3]}


def test_ratios_targets_and_missing_sides(tmp_path):
    path = tmp_path / "benchmark.json"
    path.write_text(json.dumps({"benchmarks": [
        bench("B=16 width=1024", "extend", 1.0, [JOIN]),
        bench("B=16 width=1024", "remerge", 3.5),
        bench("B=4 width=1024", "extend", 1.0, [JOIN]),
        bench("B=4 width=1024", "remerge", 2.0),
        bench("bits=4", "quantized", 0.0, [MEMORY], metric="memory", bytes_per_token=36.0),
        bench("bits=4", "bf16", 0.0, metric="memory", bytes_per_token=128.0),
        bench("B=64 width=1024", "extend", 1.0, [JOIN]),  # its re-merge side did not run
    ]}))
    headers, rows = ratio_table(path)
    assert headers == ["ratio", "case", "measured", "target", "met?"]
    table = {(r[0], r[1]): r[2:] for r in rows}
    assert table[JOIN["name"], "B=16 width=1024"] == [3.5, ">= 3", "yes"]
    assert table[JOIN["name"], "B=4 width=1024"] == [2.0, ">= 3", "NO"]
    assert table[MEMORY["name"], "bits=4"] == [0.281, "<= 0.3", "yes"]
    assert table[JOIN["name"], "B=64 width=1024"] == [None, ">= 3", "n/a"]
