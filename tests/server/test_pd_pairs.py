"""Mismatched prefill/decode pairs, with real ``launch-pd`` processes: found when the gateway first
hears both (their pongs), never chosen, named by /health and ``dsv4:incompatible_pairs``, and a
request no compatible pair can serve is a 503 before any prefill (issue 21).

(1) A decode whose checkpoint differs in one tensor's bytes (same config.json) beside a good one:
    every request is exact and served by the good one; the prefill computed only those requests.
(2) The only decode runs float32, the prefill bfloat16: 503 naming the kv dtype; nothing computed.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import httpx
import pytest
import yaml
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from engine.checkpoint.digest import weights_digest
from engine.checkpoint.shards import scan_checkpoint
from pd_util import CONFIG, assert_completions_match, start_pd, wait_incompatible_pair


def perturbed_copy(src: str, dst: Path, name: str = "norm.weight") -> Path:
    """A copy of checkpoint ``src`` whose tensor ``name`` has other values (config.json unchanged)."""
    shutil.copytree(src, dst)
    shard = dst / scan_checkpoint(dst)[name].file
    with safe_open(str(shard), "pt") as f:
        meta = f.metadata()
    tensors = load_file(str(shard))
    tensors[name] = tensors[name] * 1.5 + 0.25
    save_file(tensors, str(shard), metadata=meta)
    return dst


def _metrics(url: str) -> dict[str, float]:
    """A /metrics page as {series with labels: value}."""
    lines = httpx.get(url, timeout=10).text.splitlines()
    return {k: float(v) for k, v in (ln.rsplit(" ", 1) for ln in lines if ln and not ln.startswith("#"))}


def _metric(m: dict[str, float], name: str, **labels) -> float:
    """The sum of ``dsv4:<name>``'s series that carry ``labels``."""
    return sum(v for k, v in m.items() if k.partition("{")[0] == "dsv4:" + name
               and all(f'{a}="{b}"' in k for a, b in labels.items()))


def _worker_metrics(pd, name: str) -> dict[str, float]:
    return _metrics(pd.metrics_urls[name])


def _served(m: dict[str, float]) -> tuple[float, float]:
    """(prompt tokens, generated tokens) a worker's counters show."""
    return _metric(m, "prompt_tokens_total"), _metric(m, "generation_tokens_total")


def test_a_decode_with_other_weights_is_never_chosen(ckpt, reference, tmp_path):
    # the other weights on decode0, the instance an idle tie goes to: only the pairing keeps requests off it
    other = perturbed_copy(ckpt, tmp_path / "other-weights")
    assert (other / "config.json").read_bytes() == (Path(ckpt) / "config.json").read_bytes()
    pd = start_pd(ckpt, tmp_path / "pd.log", num_decode=2, instance_args={"decode0": ["--model", str(other)]})
    try:
        # the gateway is up once one pair is: the other decode's handshake may not be in yet
        h = wait_incompatible_pair(pd)
        hs = {n: pd.ready(n)["handshake"] for n in ("prefill0", "decode0", "decode1")}
        assert hs["decode1"]["layout"]["weights"] == weights_digest(ckpt).value == hs["prefill0"]["layout"]["weights"]
        assert hs["decode0"]["layout"]["weights"] == weights_digest(other).value != weights_digest(ckpt).value
        assert h["healthy"] and h["compatible_pairs"] == 1
        [bad] = h["incompatible_pairs"]
        cmd = pd.cmds["decode0"]
        assert bad["decode"] == f"127.0.0.1:{cmd[cmd.index('--port') + 1]}"
        assert bad["cause"] == "weights" and bad["reason"].startswith("layout.weights differs: prefill has 'sha256:")
        cases = [(40, 0.0, 1), (90, 0.8, 2), (130, 0.0, 3), (61, 0.5, 4), (200, 0.0, 5), (17, 1.0, 6)]
        assert_completions_match(pd, reference, cases, max_tokens=6)
        P = sum(n for n, _, _ in cases)
        pre, good, other_dec = (_worker_metrics(pd, n) for n in ("prefill0", "decode1", "decode0"))
        assert _served(pre) == (P, len(cases))                 # exactly the served requests were prefilled
        assert _served(good) == (P, 5 * len(cases)) and _served(other_dec) == (0, 0)
        assert _metric(other_dec, "kv_transfer_bytes_total") == 0
        assert _metric(pre, "kv_transfer_failures_total") == 0
        gw = _metrics(pd.metrics_urls["gateway"])
        assert _metric(gw, "incompatible_pairs", cause="weights") == 1
        assert _metric(gw, "incompatible_pairs", cause="kv_dtype") == 0
    finally:
        pd.stop()


# the prefill's change -> what the refusal names (decode runs configs/tiny-flash.yaml: fp32, caches unquantised)
PREFILL_DIFFERS = {
    "dtype": (("model_config", "dtype", "bfloat16"), "layout.kv_dtype differs: prefill has 'bfloat16', decode has 'float32'"),
    "cache": (("scheduler_config", "kv_cache_dtype", "fp8"),
              "layout.cache_dtype.indexer differs: prefill has 'fp8', decode has 'none'; "
              "layout.cache_dtype.kv differs: prefill has 'fp8', decode has 'none'"),
}


@pytest.mark.parametrize("what", sorted(PREFILL_DIFFERS))
def test_the_only_decode_incompatible_is_a_503_before_any_prefill(ckpt, tmp_path, what):
    """A prefill whose compute dtype, or whose decode-state caches (kv_cache_dtype), differ from the
    only decode's: never paired, a 503 naming the layout key, nothing served or transferred."""
    (section, key, value), names = PREFILL_DIFFERS[what]
    run = yaml.safe_load(Path(CONFIG).read_text())
    run.setdefault(section, {})[key] = value
    bf16 = tmp_path / "tiny-flash-prefill.yaml"
    bf16.write_text(yaml.safe_dump(run))

    def up(r: httpx.Response) -> bool:           # unhealthy by design: up once the pair is judged
        return r.status_code == 503 and bool(r.json().get("incompatible_pairs"))
    pd = start_pd(ckpt, tmp_path / "pd.log", instance_args={"prefill0": ["--config", str(bf16)]}, up=up)
    try:
        h = httpx.get(pd.base_url + "/health", timeout=10).json()
        assert not h["healthy"] and h["compatible_pairs"] == 0
        assert [p["cause"] for p in h["incompatible_pairs"]] == ["kv_dtype"]
        model = httpx.get(pd.base_url + "/v1/models", timeout=10).json()["data"][0]["id"]
        r = httpx.post(pd.base_url + "/v1/completions", timeout=30,
                       json={"model": model, "prompt": [1000, 2000, 3000], "max_tokens": 4})
        assert r.status_code == 503, r.text
        msg = r.json()["error"]["message"]
        assert msg.startswith("no compatible prefill/decode pair: prefill 127.0.0.1:")
        assert names in msg
        for name in ("prefill0", "decode0"):
            m = _worker_metrics(pd, name)
            assert _served(m) == (0, 0) and _metric(m, "request_success_total") == 0, name
            assert _metric(m, "kv_transfer_bytes_total") == 0, name
            ld = pd.ready(name)
            assert ld["running"] == ld["waiting"] == ld["reserved"] == 0, name
        assert _metric(_metrics(pd.metrics_urls["gateway"]), "incompatible_pairs", cause="kv_dtype") == 1
    finally:
        pd.stop()
