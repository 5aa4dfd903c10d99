"""Compile once: the persistent cache across processes, buckets within one, compile time apart."""
from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import jax
import pytest

import jaxkv
import models
from jaxkv import compilation

# A shape no other test compiles, so the first call here really compiles.
CONFIG = models.ModelConfig(
    model_type="llama", vocab_size=89, hidden_size=40, intermediate_size=72, num_layers=2,
    num_heads=4, num_kv_heads=2, head_dim=10, rms_norm_eps=1e-5, rope_theta=10000.0,
    rope_scaling=None, max_position_embeddings=512, tie_word_embeddings=True,
    attention_bias=False, qk_norm=False, bos_token_id=1, eos_token_ids=(2,))

# Run in a fresh process: counts JAX's persistent-cache hits and misses around a generate() call.
SCRIPT = """
import json, sys
import jax
from jax import monitoring
from jaxkv import compilation
compilation.enable_persistent_cache(compilation.cache_dir_setting(sys.argv[1]))
counts = {"hits": 0, "misses": 0}
def count(event, **_):
    if event == "/jax/compilation_cache/cache_hits": counts["hits"] += 1
    if event == "/jax/compilation_cache/cache_misses": counts["misses"] += 1
monitoring.register_event_listener(count)
import jaxkv, models
from tests.test_compile_cache import CONFIG
params = models.init_params(CONFIG, jax.random.key(0))
out = jaxkv.generate(params, CONFIG, [[5, 6, 7, 8, 9]], max_new_tokens=4, eos_ids=())
print(json.dumps({**counts, "tokens": out.tokens, "compile_seconds": out.compile_seconds}))
"""


def _run(cache_dir: pathlib.Path) -> dict:
    root = pathlib.Path(__file__).parents[1]
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(root)}
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(cache_dir)], capture_output=True, text=True,
                          cwd=root, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


def test_a_second_process_with_the_same_shapes_compiles_nothing(tmp_path):
    first = _run(tmp_path / "jax")
    assert first["misses"] > 0 and first["hits"] == 0
    assert any((tmp_path / "jax").iterdir())
    second = _run(tmp_path / "jax")
    # Every program the first process compiled is loaded from disk: no XLA compile.
    assert second["misses"] == 0 and second["hits"] == first["misses"], (first, second)
    assert second["tokens"] == first["tokens"]


def test_a_different_prompt_length_in_the_same_bucket_does_not_recompile():
    params = models.init_params(CONFIG, jax.random.key(1))
    # 37 and 45 tokens: one prefill chunk of 48 and 256 cache positions for both.
    assert jaxkv.capacity_for(37, 8) == jaxkv.capacity_for(45, 8)
    first = jaxkv.generate(params, CONFIG, [list(range(3, 40))], max_new_tokens=8, eos_ids=())
    second = jaxkv.generate(params, CONFIG, [list(range(3, 48))], max_new_tokens=8, eos_ids=())
    assert first.compile_seconds > 0
    assert second.compile_seconds == 0.0
    # A length past the bucket compiles again, and the clock sees it.
    third = jaxkv.generate(params, CONFIG, [[3 + i % 80 for i in range(300)]], max_new_tokens=8, eos_ids=())
    assert third.compile_seconds > 0


def test_buckets_are_two_per_octave():
    assert [compilation.bucket(n) for n in (1, 256, 257, 384, 385, 513, 8000, 8192, 8193)] == \
        [256, 256, 384, 384, 512, 768, 8192, 8192, 12288]
    assert compilation.bucket(9, smallest=16) == 16


def test_cache_directory_settings(monkeypatch, tmp_path):
    monkeypatch.delenv(compilation.CACHE_DIR_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert compilation.cache_dir_setting() == tmp_path / "jaxkv" / "jax"
    assert compilation.cache_dir_setting("~/elsewhere") == pathlib.Path.home() / "elsewhere"
    assert compilation.cache_dir_setting(str(tmp_path), disable=True) is None
    monkeypatch.setenv(compilation.CACHE_DIR_ENV, "off")
    assert compilation.cache_dir_setting() is None
    monkeypatch.setenv(compilation.CACHE_DIR_ENV, str(tmp_path / "c"))
    assert compilation.cache_dir_setting() == tmp_path / "c"


@pytest.mark.parametrize("spans, expected", [
    ([(0.0, 1.0), (0.5, 2.0), (3.0, 4.0)], 3.0),  # overlapping spans are counted once
    ([(0.0, 4.0), (1.0, 2.0)], 4.0),  # a nested compile (a jit traced inside another)
    ([], 0.0),
])
def test_compile_clock_counts_the_union_of_compile_spans(spans, expected):
    clock = compilation.CompileClock()
    with clock:
        for start, end in spans:
            clock._record("/jax/core/compile/backend_compile_duration", start, end)
        clock._record("/jax/some/other/event", 10.0, 20.0)
    assert clock.seconds == pytest.approx(expected)
