"""benchmarks/bench_llamacpp.py: its ratios and agreement counts, and, where llama-cpp-python is
installed (the `bench` extra, built for the CPU), llama.cpp against jaxkv on the same model: the
same logits after a prefill, and a small run end to end."""
import json
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_llamacpp  # noqa: E402
import llamacpp_engine  # noqa: E402

LLAMA_CPP_MISSING = llamacpp_engine.unavailable_reason()
needs_llama_cpp = pytest.mark.skipif(LLAMA_CPP_MISSING is not None, reason=str(LLAMA_CPP_MISSING))


def test_prefix_agreement_counts_tokens_up_to_the_first_difference():
    assert bench_llamacpp.prefix_agreement([1, 2, 3, 4], [1, 2, 9, 4]) == 2
    assert bench_llamacpp.prefix_agreement(list(range(40)), list(range(40))) == 16
    assert bench_llamacpp.prefix_agreement([5], [6]) == 0


@pytest.mark.parametrize("n,label", [(1024, "1k"), (8000, "8k"), (8192, "8k"), (32768, "32k")])
def test_context_labels(n, label):
    assert bench_llamacpp.context_label(n) == label


def row(context, engine, method, kernels, weights, decode, prefill, flash_attn=False):
    return {"context": context, "engine": engine, "method": method, "kernels": kernels, "weights": weights,
            "decode_tok_s": decode, "prefill_tok_s": prefill, "flash_attn": flash_attn}


def test_target_ratios_compare_the_best_rows_of_each_side():
    rows = [row(8000, "llama.cpp", "dense", "llama.cpp", "gguf", 26.0, 130.0),
            row(8000, "llama.cpp", "dense", "llama.cpp", "gguf", 30.0, 120.0, flash_attn=True),
            row(8000, "jaxkv", "dense", "xla", "f32", 25.0, 240.0),
            row(8000, "jaxkv", "dense", "xla", "gguf", 33.0, 230.0),
            row(8000, "jaxkv", "dense", "native", "gguf", 41.0, 230.0),
            row(8000, "jaxkv", "pariskv", "xla", "gguf", 22.0, 230.0),
            row(8000, "jaxkv", "pariskv", "native", "gguf", 120.0, 230.0),
            row(4096, "jaxkv", "dense", "xla", "gguf", 50.0, 340.0)]  # no llama.cpp row at 4k: no ratio there
    found = {t["target"]: t for t in bench_llamacpp.target_ratios(rows)}
    assert set(found) == set(bench_llamacpp.TARGETS)
    sparse = found["decode: best jaxkv sparse / best llama.cpp"]
    assert sparse["ratio"] == pytest.approx(120 / 30) and sparse["required"] == 3.5 and sparse["met"]
    assert sparse["denominator"] == "llama.cpp, flash attention on"
    dense = found["decode: best jaxkv dense / best llama.cpp"]
    assert dense["ratio"] == pytest.approx(41 / 30) and dense["required"] == 1.5 and dense["met"] is False
    xla = found["decode: best XLA sparse / XLA dense (same weights)"]
    assert xla["ratio"] == pytest.approx(22 / 33) and xla["met"] is False
    assert xla["denominator"] == "jaxkv dense (xla, Q4_1 kept)"
    prefill = found["prefill: best jaxkv / best llama.cpp"]
    assert prefill["ratio"] == pytest.approx(240 / 130) and prefill["met"] is False


def test_a_context_without_a_required_ratio_is_reported_only():
    rows = [row(16384, "llama.cpp", "dense", "llama.cpp", "gguf", 15.0, 90.0),
            row(16384, "jaxkv", "pariskv", "native", "gguf", 90.0, 150.0)]
    sparse = next(t for t in bench_llamacpp.target_ratios(rows) if t["target"].startswith("decode: best jaxkv sparse"))
    assert sparse["required"] is None and sparse["met"] is None and sparse["ratio"] == pytest.approx(6.0)


def test_prefill_flops_count_every_layer_matrix_twice_plus_attention():
    import math

    import models
    from helpers_tiny_models import tiny_config

    config = tiny_config()
    shapes = models.param_shapes(config)["layers"]
    matrices = sum(math.prod(shapes[name]) for name in ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"))
    # Position p attends to p + 1 keys: q·k and the weighted sum of v, per query head.
    attention = config.num_layers * config.num_heads * 4 * config.head_dim * np.mean(np.arange(1, 101))
    assert bench_llamacpp.prefill_flops_per_token(config, 100) == pytest.approx(2 * matrices + attention)


def test_decode_bytes_are_the_weights_and_the_keys_read():
    from helpers_tiny_models import tiny_config

    config = tiny_config()  # 2 layers, 2 KV heads of 8
    assert bench_llamacpp.kv_bytes_per_position(config, 2) == 2 * 2 * 2 * 8 * 2
    assert bench_llamacpp.decode_bytes_per_token(1000, config, 100, 4, 0.25) == 1000 + 0.25 * 100 * 256


@pytest.fixture(scope="module")
def quantized_model():
    from bench_decode import load_weights

    return load_weights("gguf")


@needs_llama_cpp
def test_llama_cpp_and_jaxkv_agree_on_tokens_and_logits(quantized_model):
    """The same GGUF through both engines: the same token ids, and after a prefill the same
    next-token logits up to the engines' different arithmetic (llama.cpp multiplies Q4_1 blocks
    by activations rounded to 8 bits and keeps its KV cache in f16)."""
    import jaxkv
    import models
    from jaxkv.eval import text

    config, params, tokenizer = quantized_model
    prompt, ids = text.long_text(tokenizer, 300)
    engine = llamacpp_engine.LlamaCpp(models.default_model_path(), n_ctx=512, threads=2, flash_attn=False)
    try:
        assert engine.tokenize(prompt) == list(ids)
        engine.prefill(list(ids[:300]))
        theirs = engine.first_logits
    finally:
        engine.close()
    ours = np.asarray(jaxkv.prefill_prompts(params, config, [ids[:300]], capacity=512).first_logits[0])
    assert int(np.argmax(theirs)) == int(np.argmax(ours))
    # Measured: correlation 0.9988 and max |difference| 0.99 over logits in [-20, 19], flash
    # attention off and on alike.
    assert np.corrcoef(theirs, ours)[0, 1] > 0.995
    assert np.max(np.abs(theirs - ours)) < 2.0


@needs_llama_cpp
def test_a_small_run_has_every_row_and_target(tmp_path):
    bench_llamacpp.main(["--contexts", "600", "1200", "--new-tokens", "16", "--rounds", "1", "--weights", "gguf",
                         "--methods", "dense", "magicpig", "--all-rows-up-to", "600", "--out", str(tmp_path)])
    result = json.loads((tmp_path / "bench_llamacpp.json").read_text())
    rows = result["rows"]
    labels = {(r["context"], bench_llamacpp.row_label(r)) for r in rows}
    assert {(600, "llama.cpp, flash attention off"), (600, "llama.cpp, flash attention on"),
            (600, "jaxkv dense (xla, Q4_1 kept)"), (600, "jaxkv magicpig (xla, Q4_1 kept)")} <= labels
    # Past --all-rows-up-to, llama.cpp runs in one flash-attention setting: the faster one at 600.
    at_600 = {r["flash_attn"]: r["decode_tok_s"] for r in rows if r["context"] == 600 and r["engine"] == "llama.cpp"}
    assert [r["flash_attn"] for r in rows if r["context"] == 1200 and r["engine"] == "llama.cpp"] == \
        [max(at_600, key=at_600.get)]
    for r in rows:
        assert r["decode_tok_s"] > 0 and r["prefill_tok_s"] > 0 and len(r["tokens"]) == 16
        assert len(r["load_averages"]) == 1 and 0 < r["keys_read_fraction"] <= 1
        if r["engine"] == "llama.cpp":
            assert set(r["greedy_agreement"]) == {"jaxkv dense (xla, Q4_1 kept)"}
            assert 0 <= r["greedy_agreement"]["jaxkv dense (xla, Q4_1 kept)"] <= 16
    magicpig = [r for r in rows if r["method"] == "magicpig"]
    assert all(r["keys_read_fraction"] < 1 and r["index_seconds"] > 0 for r in magicpig)
    targets = {(t["target"], t["context"]) for t in result["targets"]}
    assert targets == {(what, n) for what in bench_llamacpp.TARGETS for n in (600, 1200)}
    table = (tmp_path / "bench_llamacpp.md").read_text()
    assert "| 1,200 | llama.cpp, flash attention" in table and "first greedy tokens equal" in table
    assert (tmp_path / "decode_vs_context.png").stat().st_size > 10_000
