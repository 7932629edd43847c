"""kvtransfer wire format: round trip through bytes, and every corruption is refused."""
from __future__ import annotations

import msgpack
import pytest
import torch

from engine.core.llm_engine import LLMEngine
from engine.core.sampling_params import SamplingParams
from engine.checkpoint.loader import load_model
from kvtransfer.wire import TransferError, decode_state, encode_state, model_fingerprint


@pytest.fixture(scope="module")
def exported(tiny_ckpt):
    model = load_model(tiny_ckpt("flash", 1), progress=False)
    eng = LLMEngine.build(model, block_size=16, batch_size=2, max_model_len=512, num_kv_blocks=16)
    eng.add_request("r", list(range(2, 135)), SamplingParams(max_new_tokens=1, temperature=0), hold_state=True)
    while eng.has_unfinished():
        eng.step()
    seq, tensors = eng.pd.export_state("r")
    fp = model_fingerprint(model.args.to_dict(), model.dtype, {"block_size": 16})
    return fp, seq, tensors


def _bytes(frames):
    return [bytes(f) for f in frames]


def test_round_trip_is_exact(exported):
    fp, seq, tensors = exported
    frames = _bytes(encode_state("t-1", fp, seq.num_computed, seq.output_ids[0], tensors))
    h, got = decode_state(frames, fp)
    assert (h["transfer_id"], h["num_tokens"], h["first_token"]) == ("t-1", 133, seq.output_ids[0])
    assert list(got) == list(tensors)                       # layer order kept
    assert all(torch.equal(got[k], tensors[k]) and got[k].dtype == tensors[k].dtype for k in tensors)
    payload = sum(len(f) for f in frames[1:])
    assert payload == sum(t.numel() * t.element_size() for t in tensors.values())


def test_every_corruption_is_refused(exported):
    fp, seq, tensors = exported
    frames = _bytes(encode_state("t-2", fp, seq.num_computed, seq.output_ids[0], tensors))
    flipped = list(frames)
    i = 1 + list(tensors).index("layers.2.cmp_kv")
    b = bytearray(flipped[i])
    b[len(b) // 2] ^= 0x10
    flipped[i] = bytes(b)
    with pytest.raises(TransferError, match="layers.2.cmp_kv: checksum mismatch"):
        decode_state(flipped, fp)
    truncated = list(frames)
    truncated[i] = truncated[i][:-2]
    with pytest.raises(TransferError, match="truncated"):
        decode_state(truncated, fp)
    with pytest.raises(TransferError, match="tensor frames"):
        decode_state(frames[:-1], fp)
    with pytest.raises(TransferError, match="fingerprint"):
        decode_state(frames, "0" * 64)
    with pytest.raises(TransferError, match="not msgpack"):
        decode_state([b"\xc1garbage"] + frames[1:], fp)
    h = msgpack.unpackb(frames[0])
    h["tensors"][0]["shape"] = [10**6, 10**6]
    with pytest.raises(TransferError, match=r"tensors\[0\].*nbytes"):
        decode_state([msgpack.packb(h)] + frames[1:], fp)
    h = msgpack.unpackb(frames[0])
    h["tensors"][0]["dtype"] = "object"
    with pytest.raises(TransferError, match=r"tensors\[0\]: malformed"):
        decode_state([msgpack.packb(h)] + frames[1:], fp)
    with pytest.raises(TransferError, match="no frames"):
        decode_state([], fp)


def test_fingerprint_depends_on_model_dtype_and_layout(exported):
    fp, _, _ = exported
    cfg = {"hidden_size": 256}
    assert model_fingerprint(cfg, torch.float32) != model_fingerprint(cfg, torch.bfloat16)
    assert model_fingerprint(cfg, torch.float32, {"block_size": 16}) != model_fingerprint(cfg, torch.float32, {"block_size": 128})
    assert model_fingerprint(cfg, torch.float32) == model_fingerprint(dict(cfg), torch.float32)
