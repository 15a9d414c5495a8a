"""The generate command line (in process and as `python -m`), and the decode benchmark's smoke mode."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import flax_models
from flax_models.generate import main
from flax_models.testing import fake_checkpoint

SRC_ROOT = str(Path(flax_models.__file__).resolve().parent.parent)
REPO = Path(__file__).resolve().parent.parent


def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([SRC_ROOT, env.get("PYTHONPATH", "")])
    return env


def test_cli_default_preset_in_process(capsys):
    assert main(["--prompt", "Hello", "--prompt", "a longer second prompt", "--max-new-tokens", "6",
                 "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "[0] prompt 5 tokens; token ids:" in out and "[1] prompt 22 tokens" in out
    for label in ("prefill time:", "time per output token:", "tokens/s:"):
        assert label in out
    assert len(out.split("[0] prompt 5 tokens; token ids:")[1].splitlines()[0].split()) == 6


def test_cli_sampling_batch_and_dtype(capsys):
    assert main(["--model", "tiny-deepseek", "--max-new-tokens", "4", "--batch", "3", "--dtype", "bf16",
                 "--temperature", "0.7", "--top-k", "40", "--top-p", "0.9", "--seed", "3", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "[2] prompt" in out and "bfloat16" in out


def test_cli_checkpoint_directory_with_tokenizer(tmp_path, capsys):
    tokenizers = pytest.importorskip("tokenizers")
    cfg = dict(architectures=["LlamaForCausalLM"], vocab_size=32, hidden_size=16, intermediate_size=24,
               num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, eos_token_id=31)
    fake_checkpoint(cfg, tmp_path)
    vocab = {w: i for i, w in enumerate(["<unk>", "hello", "world"] + [f"w{i}" for i in range(29)])}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    assert main(["--model", str(tmp_path), "--prompt", "hello world", "--max-new-tokens", "5", "--no-progress",
                 "--ignore-eos"]) == 0
    out = capsys.readouterr().out
    text = out.split("text:")[1].splitlines()[0].split()
    assert len(text) == 5 and all(w in vocab for w in text)


def test_cli_errors(capsys):
    assert main(["--model", "no-such-model", "--no-progress"]) == 2
    assert "unknown preset 'no-such-model'" in capsys.readouterr().err
    assert main(["--top-p", "0", "--no-progress"]) == 2
    assert main(["--impl", "attention=cuda", "--no-progress"]) == 2
    assert "attention=cuda" in capsys.readouterr().err


def test_cli_per_component_impl(capsys):
    assert main(["--model", "tiny-pythia", "--impl", "attention=xla,mlp=xla", "--max-new-tokens", "2",
                 "--no-progress"]) == 0
    assert "impl=attention=xla,mlp=xla" in capsys.readouterr().out


def test_cli_as_module_with_progress_bar():
    r = subprocess.run([sys.executable, "-m", "flax_models.generate", "--model", "tiny-pythia", "--prompt", "hi",
                        "--max-new-tokens", "3"], capture_output=True, text=True, env=_env(), timeout=300)
    assert r.returncode == 0, r.stderr
    assert "time per output token" in r.stdout
    assert "decode" in r.stderr  # tqdm


def test_decode_benchmark_smoke(tmp_path):
    r = subprocess.run([sys.executable, str(REPO / "benchmarks" / "decode_e2e.py"), "--smoke", "--out-dir",
                        str(tmp_path)], capture_output=True, text=True, env=_env(), timeout=600, cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    res = json.loads((tmp_path / "decode_e2e_smoke.json").read_text())
    assert {"device", "versions", "date", "command", "rows"} <= set(res)
    cases = [row["case"] for row in res["rows"]]
    assert "tiny-llama b1 ctx64 fp32 xla" in cases and "tiny-pythia b2 ctx64 fp32 xla" in cases
    for row in res["rows"]:
        assert row["ours_us"] > 0 and 0 < row["roofline_fraction"] and row["speedup_vs_xla"] > 0
    assert (tmp_path / "decode_e2e_smoke.md").exists()


def test_decode_benchmark_in_parts(tmp_path):
    """A grid run in two parts and joined: one table, each part's rows, the GPU runs' header."""
    script = [sys.executable, str(REPO / "benchmarks" / "decode_e2e.py"), "--smoke", "--out-dir", str(tmp_path)]
    for part, combos in (("a", "1:16"), ("b", "2:16")):
        r = subprocess.run(script + ["--part", part, "--combos", combos, "--models", "tiny-llama"],
                           capture_output=True, text=True, env=_env(), timeout=600, cwd=tmp_path)
        assert r.returncode == 0, r.stdout + r.stderr
        assert (tmp_path / "parts" / f"{part}.json").exists()
    r = subprocess.run(script + ["--merge", "a,b"], capture_output=True, text=True, env=_env(), timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    res = json.loads((tmp_path / "decode_e2e_smoke.json").read_text())
    assert res["parts"] == ["a", "b"]
    assert [row["case"].rsplit(" ", 2)[0] for row in res["rows"]][::2] == ["tiny-llama b1 ctx16", "tiny-llama b2 ctx16"]
    assert "Joined from runs in parts" in (tmp_path / "decode_e2e_smoke.md").read_text()
