"""dsv4-offline: real CLI process on a tiny checkpoint and the bundled InfiniteBench-shaped sample."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from engine.build import build_engine
from engine.run_config import RunConfig
from engine.core.sampling_params import SamplingParams
from engine.tokenizer import Tokenizer
from engine.tools.dataset import build_prompt, load_dataset
from engine.tools.offline import chat_encoding, encode_sample

ROOT = Path(__file__).resolve().parents[3]
SAMPLE = ROOT / "data" / "infinitebench_sample.jsonl"


def _cli(*args, cwd=ROOT):
    return subprocess.run([sys.executable, "-m", "engine.tools.offline", *map(str, args)], cwd=cwd,
                          capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def config_file(tiny_ckpt, tmp_path_factory):
    raw = yaml.safe_load((ROOT / "configs" / "tiny-flash.yaml").read_text())
    raw["model_config"]["model_path"] = str(tiny_ckpt("flash", 1))
    raw["data_config"]["dataset_path"] = str(SAMPLE)
    raw["data_config"]["input_truncated_len"] = 200
    raw["scheduler_config"].update(max_new_tokens=6, batch_size=3, max_prefill_tokens=128)
    path = tmp_path_factory.mktemp("cfg") / "run.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def test_offline_outputs_match_the_engine_run_alone(config_file, tmp_path):
    out = tmp_path / "out.jsonl"
    r = _cli("--config", config_file, "--out", out, "--limit", 4, "--no-progress")
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    assert summary["samples"] == 4 and summary["output_tokens"] == 24
    assert "spec_decode" not in summary                                  # next_n 0: no MTP figures
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    cfg = RunConfig.from_yaml(config_file)
    samples = load_dataset(SAMPLE)[:4]
    assert [r["id"] for r in rows] == [s.id for s in samples]
    tok = Tokenizer(cfg.model_config.model_path)
    eng = build_engine(cfg, progress=False)
    enc = chat_encoding(tok.model_dir)
    for row, s in zip(rows, samples):
        ids = encode_sample(tok, enc, build_prompt(s), 200)
        # one user turn in chat mode, as DeepSeek's recipe renders it: BOS <｜User｜> text <｜Assistant｜></think>
        assert row["prompt_tokens"] == len(ids) and ids.count(tok.bos_id) == 1
        assert ids[:1] == [tok.bos_id] and ids[-2:] == [128804, 128822] and ids[1] == 128803
        ref = eng.generate([ids], SamplingParams(max_new_tokens=6, temperature=0))[0]
        assert row["output_ids"] == ref.output_ids                 # batched run == one at a time
        assert row["text"] == tok.decode(ref.output_ids, skip_special_tokens=True)
        assert row["finish_reason"] == "length" and row["answer"] == list(s.answer)
        lat = row["token_latencies_s"]
        assert len(lat) == 6 and lat[0] == row["ttft_s"] and all(x >= 0 for x in lat)


def _main(args, capsys) -> tuple[int, str]:
    """dsv4-offline's ``main`` in this process: (exit status, stderr); any other exception fails
    the test, as a traceback from the subprocess would."""
    from engine.tools.offline import main
    try:
        rc = main([str(a) for a in args])
    except SystemExit as e:
        rc = e.code
    return rc, capsys.readouterr().err


def test_offline_bad_arguments_name_the_flag(config_file, tmp_path, capsys):
    """The first case through a real subprocess, the rest through ``main`` in this process."""
    cases = [
        ((), "one of --config or --model"),
        (("--config", tmp_path / "missing.yaml"), "missing.yaml"),
        (("--model", tmp_path, "--dataset", SAMPLE), "--model"),
        (("--config", config_file, "--dataset", tmp_path / "none.jsonl"), "none.jsonl"),
        (("--config", config_file, "--limit", 0), "--limit"),
    ]
    r = _cli(*cases[0][0], "--out", tmp_path / "o.jsonl")
    assert r.returncode == 2 and cases[0][1] in r.stderr and "Traceback" not in r.stderr, r.stderr
    for args, msg in cases[1:]:
        rc, err = _main((*args, "--out", tmp_path / "o.jsonl"), capsys)
        assert rc == 2 and msg in err, (args, err)
    rc, err = _main(("--config", config_file, "--out", tmp_path / "no" / "dir.jsonl"), capsys)
    assert rc == 2 and "--out" in err
    assert not (tmp_path / "o.jsonl").exists()


@pytest.mark.parametrize("section, key, value, msg", [
    ("scheduler_config", "max_model_len", 9, "scheduler_config.max_model_len"),
    ("scheduler_config", "num_kv_blocks", 10**9, "num_kv_blocks"),
    ("scheduler_config", "cpu_memory_gb", 0.01, "mem_fraction_static"),
    ("scheduler_config", "max_model_len", 2 * 10**6, "scheduler_config.max_model_len"),
    ("data_config", "temperature", 1000.0, "data_config.temperature"),
])
def test_offline_bad_config_values_name_the_key(config_file, tmp_path, section, key, value, msg):
    raw = yaml.safe_load(Path(config_file).read_text())
    raw[section][key] = value
    cfg = tmp_path / "bad.yaml"
    cfg.write_text(yaml.safe_dump(raw))
    r = _cli("--config", cfg, "--out", tmp_path / "o.jsonl", "--limit", 1)
    assert r.returncode == 2 and msg in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert not (tmp_path / "o.jsonl").exists()


def test_offline_summary_shows_mtp_acceptance(tiny_ckpt, tmp_path, monkeypatch):
    """next_n 3 on the agreeing tiny model: the summary's spec_decode object is the engine's
    SpecStats (counts, acceptance rate, mean acceptance length), and drafts were accepted."""
    from engine.tools import offline
    raw = yaml.safe_load((ROOT / "configs" / "tiny-flash.yaml").read_text())
    raw["model_config"].update(model_path=str(tiny_ckpt("flash", 1, mtp_agree=True)), next_n=3)
    raw["data_config"].update(dataset_path=str(SAMPLE), input_truncated_len=48)
    raw["scheduler_config"].update(max_new_tokens=7, batch_size=2, max_prefill_tokens=256)
    built = []
    monkeypatch.setattr(offline, "build_engine", lambda *a, **k: built.append(build_engine(*a, **k)) or built[-1])
    summary = offline.run(RunConfig.from_dict(raw), None, str(SAMPLE), str(tmp_path / "o.jsonl"), limit=2,
                          progress=False)
    st = built[0].spec.stats
    spec = summary["spec_decode"]
    assert spec == {"next_n": 3, "num_drafts": st.num_drafts, "num_draft_tokens": st.num_draft_tokens,
                    "num_accepted_tokens": st.num_accepted_tokens,
                    "num_accepted_tokens_per_pos": st.num_accepted_tokens_per_pos,
                    "acceptance_rate": round(st.num_accepted_tokens / st.num_draft_tokens, 4),
                    "mean_acceptance_length": round(1 + st.num_accepted_tokens / st.num_drafts, 4)}
    assert spec["num_drafts"] >= 2 and spec["acceptance_rate"] >= 0.5
    assert summary["output_tokens"] == 14
