"""``bench.bench_cache_dtype`` and the cache-dtype option of ``bench.bench_transfer``: the figures
are reference §4's (state per request, P/D bytes of a 4K prompt from the per-row storage), the
quantised state messages build and decode, and the bench runs in one command."""
from __future__ import annotations

import json

import pytest

from bench import bench_cache_dtype as bc
from bench import bench_transfer as bt
from engine.cache_dtype import SETTINGS, CacheDtype
from engine.config import ModelArgs

MIB = 1 << 20


@pytest.mark.parametrize("setting", sorted(SETTINGS))
def test_bench_transfer_builds_and_decodes_the_state_in_each_cache_dtype(setting):
    from kvtransfer.wire import decode_state
    cache = CacheDtype(*SETTINGS[setting])
    shapes = bt.shapes_for("tiny-4k", cache)
    frames = bt.build("tiny-4k", cache)
    assert bt.nbytes_of(frames) > bt.state_bytes(shapes)                     # + the header
    _, tensors = decode_state(frames, bt.FP)
    assert {k: (tuple(t.shape), t.dtype) for k, t in tensors.items()} == shapes
    assert ("layers.2.idx_kv.scale" in shapes) == (cache.indexer in ("int8", "fp8"))


@pytest.mark.parametrize("setting, kv, idx", [("bfloat16", 1024, 256), ("int8", 1024, 130), ("fp8", 640, 132),
                                              ("hif8", 512, 128)])
def test_pd_bytes_of_a_4k_prompt_are_reference_section_4s(setting, kv, idx):
    """L = 4096 (a multiple of 128: no partial remainders): per layer 127 window rows, CSA 1024
    compressed + 1024 indexer entries + the closed window's fp32 [4, 512] / [4, 128] kv and score,
    HCA 32 entries; rows as §4 stores them."""
    a = ModelArgs.from_json(bc.MODELS["Flash"])
    n_csa, n_hca = 21, 20
    want = (a.num_hidden_layers * 127 * kv + n_csa * 1024 * (kv + idx) + n_hca * 32 * kv
            + n_csa * 2 * 4 * (512 + 128) * 4)
    assert bc.transfer_mib(a, CacheDtype(*SETTINGS[setting])) == want / MIB


def test_the_bench_prints_every_cache_dtype_side_by_side(capsys, tmp_path):
    rows = bc.measure()
    assert list(rows) == list(SETTINGS)
    assert rows["bfloat16"]["state_mib"]["Flash"][131072] == pytest.approx(877.02, abs=0.01)
    assert rows["int8"]["state_mib"]["Flash"][131072] == pytest.approx(794.33, abs=0.01)        # §4: 794
    assert rows["fp8"]["state_mib"]["Pro"][131072] == pytest.approx(765.73, abs=0.01)           # §4: 766
    assert [rows[s]["rank"]["platform"] for s in SETTINGS] == ["A3", "A3", "950", "950"]
    assert rows["int8"]["rank"]["requests"][131072] > rows["bfloat16"]["rank"]["requests"][131072]
    mib = [rows[s]["transfer_mib"]["Pro"] for s in SETTINGS]
    assert mib == sorted(mib, reverse=True)
    assert bc.main(["--out", str(tmp_path / "cache_dtype.json"), "--no-accuracy"]) == 0
    out = capsys.readouterr().out
    assert "A3 lacks FP8 / HiF8, so fp8 / hif8 are planned on a 950 rank" in out
    assert "| fp8 | fp8 / fp8 | 48.2 | 534.1 |" in out
    assert out.rstrip().endswith(bc.ACCURACY_HINT)
    assert set(json.loads((tmp_path / "cache_dtype.json").read_text())["rows"]) == set(SETTINGS)
