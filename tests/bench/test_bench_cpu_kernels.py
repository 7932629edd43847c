"""``python -m bench.bench_cpu_kernels``: its ops table measures the reference, the compiled reference
and the kernel on the same inputs, beside a limit computed from the stored bytes."""
import pytest

from bench.bench_cpu_kernels import ops_rows


def test_ops_rows_time_every_path_beside_the_stored_bytes_limit(tiny_ckpt):
    rows = ops_rows(tiny_ckpt("flash", 1), {"read_gbs": 10.0}, fp8_shapes=[(256, 512)],
                    moe_shapes=[(4, 64, 256, (1, 2))])
    head = [r for r in rows if r["op"].startswith("lm_head")]
    fp8 = [r for r in rows if r["op"].startswith("fp8")]
    moe = [r for r in rows if r["op"].startswith("moe")]
    assert [r["rows"] for r in head] == [1, 8, 64] and [r["rows"] for r in fp8] == [1, 2, 4]
    assert [r["rows"] for r in moe] == [1, 2] and all(r["compiled_reference"] > 0 for r in moe)
    # 6 gathered experts a row, each w1 + w3 (64 x 128 bytes, 64 x 8 scales) and w2 (256 x 32, 256 x 2)
    assert moe[0]["limit"] == 1e3 * 6 * (2 * (64 * 128 + 64 * 8) + 256 * 32 + 256 * 2) / 10e9
    assert all(r["compiled_reference"] is None for r in head)
    assert all(r["reference"] > 0 and r["kernel"] > 0 for r in rows)
    assert head[0]["limit"] == 1e3 * 129280 * 256 * 2 / 10e9          # bf16 head bytes / 10 GB/s
    assert fp8[0]["limit"] == 1e3 * (256 * 512 + 2 * 4) / 10e9        # e4m3 bytes + e8m0 scales


def test_a_checkpoint_without_a_head_is_named(tmp_path):
    with pytest.raises(SystemExit, match="--ckpt: no head.weight in"):
        ops_rows(tmp_path, {"read_gbs": 10.0})
