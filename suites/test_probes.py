"""L0 backend probes: every op is batch-invariant on the CPU, and the probe
can tell when one is not."""

import math

import mlx.core as mx
import pytest
from tabulate import tabulate

from kvparity.oracle import probes
from kvparity.oracle.mlx_lm_versions import defects_for
from kvparity.oracle.probes import (
    MLX_LM_OPS,
    OPS,
    ProbeResult,
    ProbeShapes,
    ProbeUnavailable,
    compare_rows,
    probe_table,
    run_probes,
)

BATCH_SIZES = (1, 2, 4, 8)


def llama_like(dtype):
    return ProbeShapes.from_args(
        hidden_size=128,
        n_heads=4,
        n_kv_heads=2,
        head_dim=64,
        vocab_size=256,
        dtype=dtype,
    )


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float32], ids=["bf16", "f32"])
def test_every_op_is_batch_invariant_on_cpu(dtype):
    results = run_probes(llama_like(dtype), BATCH_SIZES, device="cpu")

    assert [(r.op, r.batch_size) for r in results] == [
        (op, b) for op in OPS for b in BATCH_SIZES
    ]
    # Where the installed mlx-lm's own attention is wrong for these shapes, the
    # probe must say so (suites/test_mlx_lm_versions.py); every other op holds.
    defective = bool(defects_for(4, 2))
    for r in results:
        if defective and r.op in MLX_LM_OPS and r.batch_size > 1:
            assert not r.invariant and r.attribution is not None, r
            continue
        assert r.error is None, r
        assert r.invariant and r.attribution is None, r
        assert r.max_abs_diff == 0.0 and r.first_row is None, r


def test_table_formats_with_tabulate():
    results = [
        ProbeResult("matmul", 1, True, 0.0, None, None),
        ProbeResult("matmul", 8, False, 1.2e-3, 3, None),
        ProbeResult("quantized_matmul", 1, True, 0.0, None, None),
        ProbeResult(
            "quantized_matmul", 8, False, math.nan, None, "ValueError: no kernel\nmore"
        ),
    ]
    headers, rows = probe_table(results)

    assert headers == ["op", "B=1", "B=8"]
    assert rows == [
        ["matmul", "yes", "NO (1.2e-03)"],
        ["quantized_matmul", "yes", "error: ValueError: no kernel"],
    ]
    text = tabulate(rows, headers=headers)
    assert "NO (1.2e-03)" in text and "error: ValueError" in text


def test_table_of_a_real_run():
    results = run_probes(llama_like(mx.float32), (1, 2), device="cpu")
    headers, rows = probe_table(results)
    assert headers == ["op", "B=1", "B=2"]
    assert [row[0] for row in rows] == list(OPS)
    defective = bool(defects_for(4, 2))
    for row in rows:
        marked = defective and row[0] in MLX_LM_OPS
        assert row[1] == "yes" and (row[2].endswith("[mlx-lm defect]") if marked else row[2] == "yes"), row


def test_probe_reports_an_op_that_depends_on_batch_position(monkeypatch):
    matmul = OPS["matmul"]

    # Rows from 2 on are nudged in the batched run only, as a kernel that
    # switches tiling past two rows would do.
    def leaky(shapes, B, seed):
        batched, solos = matmul(shapes, B, seed)
        nudge = (mx.arange(B) >= 2).reshape(B, 1, 1).astype(shapes.dtype) / 64
        return (batched[0] + nudge, *batched[1:]), solos

    monkeypatch.setitem(OPS, "matmul", leaky)
    results = {
        r.batch_size: r
        for r in run_probes(llama_like(mx.bfloat16), BATCH_SIZES)
        if r.op == "matmul"
    }

    assert results[1].invariant and results[2].invariant
    for B in (4, 8):
        r = results[B]
        assert not r.invariant and r.error is None
        assert r.first_row == 2
        assert r.max_abs_diff > 0.0


def test_probe_reports_an_op_that_mixes_rows(monkeypatch):
    # A kernel that sums across the batch: fine alone, wrong from row 0 at B >= 2.
    def mixing(shapes, B, seed):
        rows = [(probes._normal((1, 8), shapes.dtype, seed, "x", i),) for i in range(B)]
        kernel = lambda x: (x + x.sum(axis=0, keepdims=True),)
        return probes._run(kernel, probes._stack_rows(rows), rows)

    monkeypatch.setattr(probes, "OPS", {"mixing": mixing})
    results = run_probes(llama_like(mx.float32), (1, 2))

    assert [(r.invariant, r.first_row) for r in results] == [(True, None), (False, 0)]
    assert results[1].max_abs_diff > 0.0


def test_an_op_that_raises_is_an_error_not_a_crash(monkeypatch):
    def broken(shapes, B, seed):
        if B > 1:
            raise ValueError("no kernel for this shape")
        return OPS["quantize"](shapes, B, seed)

    monkeypatch.setattr(probes, "OPS", {"broken": broken, "quantize": OPS["quantize"]})
    results = run_probes(llama_like(mx.float32), (1, 2))

    assert [(r.op, r.batch_size, r.invariant) for r in results] == [
        ("broken", 1, True),
        ("broken", 2, False),
        ("quantize", 1, True),
        ("quantize", 2, True),
    ]
    assert results[1].error == "ValueError: no kernel for this shape"
    _, rows = probe_table(results)
    assert rows[0][2] == "error: ValueError: no kernel for this shape"


def test_bytes_not_values_are_compared():
    # array_equal calls these equal; the probe must not.
    zero = mx.array([[0.0]], dtype=mx.bfloat16)
    assert mx.array_equal(zero, -zero)
    assert compare_rows((zero,), [(-zero,)]) == (False, 0.0, 0)

    nan = mx.array([[math.nan]])
    assert compare_rows((nan,), [(nan,)]) == (True, 0.0, None)
    assert compare_rows((nan,), [(mx.array([[1.0]]),)]) == (False, math.inf, 0)

    # Same values in another dtype or shape are not the same output.
    one = mx.array([[1.0]])
    assert not compare_rows((one,), [(one.astype(mx.float16),)])[0]
    assert not compare_rows((one,), [(one.reshape(1, 1, 1),)])[0]


def test_unavailable_device_is_a_clear_error():
    if mx.is_available(mx.gpu):
        pytest.skip("this MLX build has a GPU")
    with pytest.raises(ProbeUnavailable, match="not available"):
        run_probes(llama_like(mx.float32), (1,), device="gpu")


def test_shapes_are_checked():
    assert llama_like("bfloat16").dtype == mx.bfloat16
    with pytest.raises(ValueError, match="does not divide"):
        ProbeShapes.from_args(
            hidden_size=128, n_heads=4, n_kv_heads=2, head_dim=96,
            vocab_size=256, dtype=mx.float32, kv_group_size=64,
        )
    with pytest.raises(ValueError, match="n_kv_heads"):
        ProbeShapes.from_args(
            hidden_size=128, n_heads=4, n_kv_heads=3, head_dim=64,
            vocab_size=256, dtype=mx.float32,
        )
    with pytest.raises(ValueError, match="kv_bits"):
        ProbeShapes.from_args(
            hidden_size=128, n_heads=4, n_kv_heads=2, head_dim=64,
            vocab_size=256, dtype=mx.float32, kv_bits=7,
        )
