"""dsv4-generate: a real subprocess on the tiny checkpoint, real tokenizer, clear CLI errors."""
import json
import subprocess
import sys

import torch

from engine.checkpoint.loader import load_model
from engine.tokenizer import Tokenizer
from engine.tools.generate import generate_greedy


def cli(*args):
    return subprocess.run([sys.executable, "-m", "engine.tools.generate", *args], capture_output=True, text=True,
                          timeout=300, errors="surrogateescape")


def test_non_finite_logits_are_an_error_not_tokens(tiny_ckpt):
    import pytest
    from engine.tools.generate import NonFiniteLogits

    model = load_model(tiny_ckpt("flash", 1), progress=False)
    model.head.weight.data[5] = float("nan")
    with pytest.raises(NonFiniteLogits, match="non-finite logits at position 2"):
        generate_greedy(model, [0, 1, 2], 4)


def test_generate_json_matches_in_process_greedy(tiny_ckpt):
    ckpt = str(tiny_ckpt("flash", 1))
    r = cli("--model", ckpt, "--prompt", "The capital of France is", "--max-new-tokens", "12", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    tok = Tokenizer(ckpt)
    assert out["prompt_ids"] == tok.encode("The capital of France is", add_bos=True) and out["prompt_ids"][0] == 0
    model = load_model(ckpt, progress=False)
    expect = generate_greedy(model, out["prompt_ids"], 12, tok.eos_id)
    assert out["output_ids"] == expect and len(expect) == 12
    assert out["text"] == tok.decode(expect)
    # greedy = argmax of a full forward over prompt + output at every step
    ids = torch.tensor(out["prompt_ids"] + expect)
    logits = model.logits(model(ids, model.new_state()))
    n = len(out["prompt_ids"])
    assert logits[n - 1:-1].argmax(-1).tolist() == expect


def test_generate_prompt_ids_bf16_and_plain_text(tiny_ckpt):
    ckpt = str(tiny_ckpt("pro", 1))
    r = cli("--model", ckpt, "--prompt-ids", "0,100,200,300", "--max-new-tokens", "3", "--dtype", "bf16", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["prompt_ids"] == [0, 100, 200, 300] and len(out["output_ids"]) == 3
    r = cli("--model", ckpt, "--prompt", "hi", "--max-new-tokens", "2")
    assert r.returncode == 0 and r.stdout.strip() != ""


def _main(args, capsys) -> tuple[int, str]:
    """dsv4-generate's ``main`` in this process: (exit status, stderr). Any exception but the
    CLI's own exit propagates and fails the test (what a traceback in a subprocess would show)."""
    from engine.tools.generate import main
    try:
        rc = main(list(args))
    except SystemExit as e:
        rc = e.code
    return rc, capsys.readouterr().err


def test_generate_bad_input_names_the_field(tiny_ckpt, tmp_path, capsys):
    """The first case through a real subprocess (exit status and stderr of the installed entry
    point), the rest through ``main`` in this process (same parser and checks, no interpreter
    start-up each)."""
    ckpt = str(tiny_ckpt("flash", 1))
    cases = [
        (["--model", ckpt, "--prompt-ids", "1,x"], "--prompt-ids: expected comma-separated integers"),
        (["--model", ckpt, "--prompt-ids", "1,129280"], "--prompt-ids: ids must be in [0, 129280)"),
        (["--model", ckpt, "--prompt-ids", ","], "--prompt-ids: expected at least one id"),
        (["--model", ckpt, "--prompt", "a", "--max-new-tokens", "-1"], "--max-new-tokens: must be >= 0"),
        (["--model", str(tmp_path / "nope"), "--prompt", "a"], "--model: directory"),
        (["--model", str(tmp_path), "--prompt", "a"], "config.json: not found"),
        (["--model", "", "--prompt", "a"], "--model: directory"),
        (["--model", ckpt, "--prompt-ids", "1,,2"], "--prompt-ids: expected comma-separated integers"),
        (["--model", ckpt, "--prompt-ids", "1_0"], "--prompt-ids: expected comma-separated integers"),
        (["--model", ckpt, "--prompt", "\udcff\udcfe"], "--prompt: not valid UTF-8"),
        (["--model", ckpt, "--prompt-ids", "1", "--max-new-tokens", "1048576"],
         "--max-new-tokens: prompt (1 tokens) + 1048576 new tokens exceeds the model's max_position_embeddings"),
    ]
    r = cli(*cases[0][0])
    assert r.returncode == 2 and cases[0][1] in r.stderr and "Traceback" not in r.stderr, r.stderr
    for args, msg in cases[1:]:
        rc, err = _main(args, capsys)
        assert rc == 2 and msg in err, (args, err)
