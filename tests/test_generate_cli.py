"""The generate command line (in process and as `python -m`), and the decode benchmark's smoke mode."""

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import pytest

import flax_models
from flax_models import generate as generate_cli
from flax_models import ops
from flax_models.generate import main
from flax_models.presets import PRESETS
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


def _usage_error(capsys, monkeypatch, argv):
    """main(argv) must fail with exit code 2 and one line on stderr, before any weight exists."""
    def no_weights(*a, **k):
        raise AssertionError("weights were made or loaded before the argument error")

    monkeypatch.setattr(generate_cli, "load_model", no_weights)
    assert main(argv + ["--no-progress"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    assert err.startswith("python -m flax_models.generate: error: ")
    return err


@pytest.mark.parametrize("argv, message", [
    (["--max-new-tokens", "0"], "--max-new-tokens: must be >= 1, got 0"),
    (["--max-new-tokens", "-1"], "--max-new-tokens: must be >= 1, got -1"),
    (["--batch", "0"], "--batch: must be >= 1, got 0"),
    (["--batch", "-2"], "--batch: must be >= 1, got -2"),
    (["--model", "/no/such/checkpoint"], "checkpoint directory '/no/such/checkpoint' does not exist"),
    (["--model", "no-such-model"], "'no-such-model' is neither a preset nor an existing checkpoint directory; "
                                   "presets: deepseek-v2-lite, "),
    (["--top-p", "0"], "top_p must be in (0, 1]"),
    (["--impl", "attention=cuda"], "attention=cuda"),
    (["--impl", "fast"], "impl must be one of"),
    (["--prompt", "x" * 4097], "prompt 0 is 4097 tokens, longer than the model's context of 4096 tokens"),
    (["--prompt", "hi", "--prompt", "x" * 4000, "--max-new-tokens", "100"],
     "prompt 1 (4000 tokens) + --max-new-tokens 100 exceeds the model's context of 4096 tokens"),
    (["--model", "tiny-pythia", "--impl", "attention=fused,mlp=fused", "--dtype", "fp16", "--max-new-tokens",
      "5000"], "exceeds the model's context"),
    (["--page-size", "16"], "a paged cache is MLA's (DeepSeek): Llama keeps contiguous rows"),
    (["--model", "tiny-deepseek", "--page-size", "0"], "--page-size: must be >= 1, got 0"),
    (["--batch", "3", "--data-parallel", "2"], "the batch of 3 rows does not split evenly"),
    (["--data-parallel", "4096"], "--data-parallel 4096: only"),
    (["--model", "tiny-deepseek", "--batch", "2", "--data-parallel", "2", "--page-size", "16"],
     "a page pool is shared by the rows"),
])
def test_cli_bad_inputs_are_one_line_errors_before_anything_runs(capsys, monkeypatch, argv, message):
    assert message in _usage_error(capsys, monkeypatch, argv)


def test_cli_checkpoint_path_that_is_not_a_checkpoint(tmp_path, capsys, monkeypatch):
    assert "without config.json" in _usage_error(capsys, monkeypatch, ["--model", str(tmp_path)])
    (tmp_path / "weights.bin").write_bytes(b"")
    assert "is a file" in _usage_error(capsys, monkeypatch, ["--model", str(tmp_path / "weights.bin")])


def test_cli_fused_fp32_names_the_dtype(capsys, monkeypatch):
    """tiny-llama's D and F are multiples of 64: what the SwiGLU op lacks is a float32 kernel."""
    if not (ops.fused_available("attention_block") and ops.fused_available("swiglu")):
        pytest.skip("jax_cluster ops not available")
    err = _usage_error(capsys, monkeypatch, ["--impl", "attention=fused,mlp=fused", "--dtype", "fp32"])
    assert "swiglu" in err and "float32" in err
    assert "multiple" not in err


def test_cli_summary_says_what_ran_on_cpu(capsys):
    assert main(["--max-new-tokens", "2", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "attention_block: xla (no GPU: impl=auto runs XLA on CPU)" in out
    assert "swiglu: xla (no GPU: impl=auto runs XLA on CPU)" in out
    assert "C++ CPU handlers" in out


def test_cli_summary_names_a_fallback_and_its_reason(capsys, monkeypatch):
    """On a GPU, impl=auto with a float32 model runs XLA for every block and says why."""
    monkeypatch.setattr(ops, "on_gpu", lambda: True)
    assert main(["--dtype", "fp32", "--max-new-tokens", "2", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "attention_block: xla (float32 has no CUDA kernel)" in out
    assert "swiglu: xla (float32 has no CUDA kernel)" in out
    assert "C++ CPU handlers" not in out


def test_cli_fused_on_cpu_runs_the_cpu_handlers(capsys):
    if not (ops.fused_available("attention_block") and ops.fused_available("swiglu")):
        pytest.skip("jax_cluster ops not available")
    assert main(["--impl", "attention=fused,mlp=fused", "--dtype", "bf16", "--max-new-tokens", "2",
                 "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "attention_block: jax_cluster (C++ CPU handler, no GPU)" in out
    assert "swiglu: jax_cluster (C++ CPU handler, no GPU)" in out
    if ops.fused_available("decoder_layer"):  # plain fused: whole layers
        assert main(["--impl", "fused", "--dtype", "bf16", "--max-new-tokens", "2", "--no-progress"]) == 0
        assert "decoder_layer: jax_cluster (C++ CPU handler, no GPU)" in capsys.readouterr().out


def test_cli_fused_pythia_runs_whole_layers_on_cpu(capsys):
    """GPT-NeoX under --impl fused: its layers on jax_cluster.decoder_layer's C++ CPU handler."""
    if not ops.fused_available("decoder_layer"):
        pytest.skip("jax_cluster.decoder_layer not available")
    assert main(["--model", "tiny-pythia", "--impl", "fused", "--max-new-tokens", "2", "--no-progress"]) == 0
    assert "decoder_layer: jax_cluster (C++ CPU handler, no GPU)" in capsys.readouterr().out


FUSABLE_DEEPSEEK = dict(architectures=["DeepseekV2ForCausalLM"], model_type="deepseek_v2", vocab_size=64,
                        hidden_size=64, intermediate_size=128, moe_intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, kv_lora_rank=16, q_lora_rank=None, qk_nope_head_dim=8,
                        qk_rope_head_dim=8, v_head_dim=8, n_routed_experts=8, num_experts_per_tok=2,
                        n_shared_experts=1, first_k_dense_replace=1, max_position_embeddings=256, eos_token_id=63)


def test_cli_fused_deepseek_on_cpu_runs_every_block_on_the_cpu_handlers(tmp_path, capsys):
    """A DeepSeek-V2 whose SwiGLU widths are multiples of 64: MLA, the dense SwiGLU and the MoE
    (routed experts, shared experts inside moe_decode) all on jax_cluster."""
    if not all(ops.fused_available(op) for op in ("mla_decode", "moe_decode", "swiglu")):
        pytest.skip("jax_cluster ops not available")
    fake_checkpoint(FUSABLE_DEEPSEEK, tmp_path)
    assert main(["--model", str(tmp_path), "--impl", "fused", "--dtype", "bf16", "--batch", "2",
                 "--max-new-tokens", "3", "--ignore-eos", "--no-progress"]) == 0
    out = capsys.readouterr().out
    for block in ("mla_decode", "swiglu", "moe"):
        assert f"{block}: jax_cluster (C++ CPU handler, no GPU)" in out, out


def test_cli_paged_latent_cache(capsys):
    argv = ["--model", "tiny-deepseek", "--prompt", "one", "--prompt", "a second prompt", "--max-new-tokens", "6",
            "--ignore-eos", "--no-progress"]
    assert main(argv) == 0
    want = capsys.readouterr().out.splitlines()[:2]
    assert main(argv + ["--page-size", "4"]) == 0
    assert capsys.readouterr().out.splitlines()[:2] == want


def test_cli_fused_tiny_deepseek(capsys, monkeypatch):
    """tiny-deepseek --impl fused (bf16): runs on the CPU handlers when its shared-expert width
    (moe_intermediate_size * n_shared_experts) is a multiple of 64, which jax_cluster.swiglu
    needs; otherwise a one-line error naming the MoE's shared experts and the width."""
    if not all(ops.fused_available(op) for op in ("mla_decode", "moe_decode", "swiglu")):
        pytest.skip("jax_cluster ops not available")
    cfg = PRESETS["tiny-deepseek"]
    width = cfg.moe_intermediate_size * cfg.n_shared_experts
    argv = ["--model", "tiny-deepseek", "--impl", "fused", "--dtype", "bf16", "--max-new-tokens", "2"]
    if width % 64:
        err = _usage_error(capsys, monkeypatch, argv)
        assert "impl='fused' for moe: moe_decode: the shared experts" in err and f"F={width}" in err, err
        return
    assert main(argv + ["--no-progress"]) == 0
    assert "moe: jax_cluster (C++ CPU handler, no GPU)" in capsys.readouterr().out


def test_cli_fused_tiny_deepseek_v3(capsys):
    """tiny-deepseek-v3 --impl fused on CPU: V3's router (noaux_tc) in moe_decode's router call,
    MLA with q LoRA on mla_decode, through the C++ CPU handlers (the model's numbers against
    transformers: tests/test_models_deepseek_v2.py)."""
    if not all(ops.fused_available(op) for op in ("mla_decode", "moe_decode", "swiglu")):
        pytest.skip("jax_cluster ops not available")
    assert main(["--model", "tiny-deepseek-v3", "--impl", "fused", "--dtype", "bf16", "--max-new-tokens", "4",
                 "--no-progress"]) == 0
    out = capsys.readouterr().out
    for block in ("moe", "mla_decode"):
        assert f"{block}: jax_cluster (C++ CPU handler, no GPU)" in out, out


def test_cli_preset_dtype_follows_fused_impl(capsys, monkeypatch):
    """Presets on CPU default to float32, and to bfloat16 when an op is asked to run fused (the
    fused MLP, jax_cluster.swiglu, takes 16-bit activations only): the fused commands run
    without --dtype; fp32 asked for explicitly with a fused op gets the error and what to pass
    instead."""
    if jax.default_backend() != "cpu" or not all(ops.fused_available(op) for op in ("mla_decode", "moe_decode",
                                                                                   "swiglu", "attention_block")):
        pytest.skip("CPU with the jax_cluster ops")
    for model, impl, dtype in (("tiny-llama", "auto", "float32"),
                               ("tiny-llama", "attention=fused,mlp=fused", "bfloat16"),
                               ("tiny-deepseek", "fused", "bfloat16")):
        assert main(["--model", model, "--impl", impl, "--max-new-tokens", "2", "--no-progress"]) == 0
        out = capsys.readouterr().out
        assert f"{dtype})" in out, (model, impl, out)
    err = _usage_error(capsys, monkeypatch, ["--model", "tiny-llama", "--impl", "mlp=fused", "--dtype", "fp32"])
    assert "no kernel for dtype float32" in err and "pass --dtype bf16 or fp16" in err, err


def test_cli_per_component_impl(capsys):
    assert main(["--model", "tiny-pythia", "--impl", "attention=xla,mlp=xla", "--max-new-tokens", "2",
                 "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "impl=attention=xla,mlp=xla" in out
    assert "attention_block: xla (impl=xla)" in out and "gelu_mlp: xla (impl=xla)" in out


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
    assert "tiny-llama b1 ctx64 fp16 xla" in cases and "tiny-pythia b2 ctx64 fp16 xla" in cases
    for row in res["rows"]:
        assert row["ours_us"] > 0 and 0 < row["roofline_fraction"] and row["speedup_vs_xla"] > 0
    assert (tmp_path / "decode_e2e_smoke.md").exists()


def test_decode_benchmark_in_parts(tmp_path):
    """A grid run in two slices (--part): one table with each slice's rows and both runs listed;
    a slice run again replaces its rows."""
    script = [sys.executable, str(REPO / "benchmarks" / "decode_e2e.py"), "--smoke", "--out-dir", str(tmp_path)]
    for part, combos in (("a", "1:16"), ("b", "2:16"), ("a", "1:16")):
        r = subprocess.run(script + ["--part", part, "--combos", combos, "--models", "tiny-llama"],
                           capture_output=True, text=True, env=_env(), timeout=600, cwd=tmp_path)
        assert r.returncode == 0, r.stdout + r.stderr
    assert not (tmp_path / "parts").exists()
    res = json.loads((tmp_path / "decode_e2e_smoke.json").read_text())
    assert res["parts"] == ["b", "a"]
    assert sorted({row["case"].rsplit(" ", 2)[0] for row in res["rows"]}) == ["tiny-llama b1 ctx16",
                                                                             "tiny-llama b2 ctx16"]
    assert "Joined from runs in parts" in (tmp_path / "decode_e2e_smoke.md").read_text()


def test_cli_data_parallel_splits_the_rows(capsys):
    """--data-parallel 2 on CPU devices: the batch's rows over two devices, the same tokens as
    the rows on one (the rows are the same prompt)."""
    argv = ["--model", "tiny-llama", "--impl", "fused", "--batch", "4", "--max-new-tokens", "4", "--no-progress"]
    assert main(argv) == 0
    one = capsys.readouterr().out
    assert main(argv + ["--data-parallel", "2"]) == 0
    two = capsys.readouterr().out
    assert "batch 4 over 2 devices" in two
    assert [ln for ln in two.splitlines() if ln.startswith("[")] == [ln for ln in one.splitlines() if ln.startswith("[")]


def test_decode_benchmark_data_parallel(tmp_path):
    """decode_e2e.py --data-parallel 2 (CPU devices): rows over two devices, case suffix dp2; a
    batch that does not split is listed as skipped."""
    r = subprocess.run([sys.executable, str(REPO / "benchmarks" / "decode_e2e.py"), "--smoke", "--out-dir",
                        str(tmp_path), "--models", "tiny-llama", "--combos", "2:16,1:16", "--data-parallel", "2"],
                       capture_output=True, text=True, env=_env(), timeout=600, cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    rows = {row["case"]: row for row in json.loads((tmp_path / "decode_e2e_smoke.json").read_text())["rows"]}
    assert rows["tiny-llama b2 ctx16 fp16 dp2 fused"]["ours_us"] > 0
    assert rows["tiny-llama b1 ctx16 fp16 dp2 xla"]["skipped"] == "1 rows do not split over 2 devices"
