"""`jaxkv serve` driven by the official openai client over loopback.

A tiny random Llama with a small byte-level BPE tokenizer is saved as a
checkpoint and served by `python -m jaxkv.cli serve` in a subprocess on
127.0.0.1. Greedy answers are compared with jaxkv.generate() run here on the
same checkpoint, one prompt at a time. Every request has a timeout; the server
is stopped with SIGTERM and must exit with status 0.
"""
from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import jax
import pytest
import tokenizers
from tokenizers import decoders, pre_tokenizers, trainers

import jaxkv
import models
from jaxkv.attention.pariskv import ParisKVConfig
from jaxkv.cache import CacheConfig

openai = pytest.importorskip("openai", reason="the serve tests drive the server with the openai package")
pytest.importorskip("uvicorn", reason="jaxkv serve needs the 'serve' extra")

MODEL = "tiny"
TEXT = ("The quick brown fox jumps over the lazy dog. A long context needs a cache; sparse attention "
        "reads a small part of it. Paris is the capital of France. Numbers: 0 1 2 3 4 5 6 7 8 9. ") * 20
# A sparse method small enough for the tiny model, sparse from the first step.
PARIS = dict(settings=dict(m=4, top_k=12, sink=2, local=4, buffer=3), cache=dict(dense_threshold=0))


def _tokenizer() -> models.Tokenizer:
    backend = tokenizers.Tokenizer(tokenizers.models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    backend.train_from_iterator([TEXT], trainer)
    return models.Tokenizer(backend, eos_token_ids=(backend.token_to_id("<|im_end|>"),), eos_token="<|im_end|>")


def _save_tiny(path, eos: bool):
    tokenizer = _tokenizer()
    config = models.ModelConfig(
        model_type="llama", vocab_size=tokenizer.vocab_size, hidden_size=64, intermediate_size=128, num_layers=2,
        num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0, rope_scaling=None,
        max_position_embeddings=4096, tie_word_embeddings=True, attention_bias=False, qk_norm=False,
        bos_token_id=None, eos_token_ids=tokenizer.eos_token_ids if eos else ())
    # std 0.02 init makes every logit nearly equal; scaled up, greedy choices are clear-cut.
    params = jax.tree.map(lambda x: x * 12 if x.ndim > 1 else x, models.init_params(config, jax.random.key(0)))
    models.save(path, config, params, tokenizer)
    return path


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return _save_tiny(tmp_path_factory.mktemp("serve") / "tiny", eos=True)


@pytest.fixture(scope="module")
def model(checkpoint):
    return models.load(checkpoint)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class Server:
    """`jaxkv serve` in a subprocess; stop() sends SIGTERM and returns its exit status."""

    def __init__(self, checkpoint, *flags: str):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "JAXKV_COMPILATION_CACHE": "off", "JAX_PLATFORMS": "cpu"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "jaxkv.cli", "serve", "--model", str(checkpoint), "--model-name", MODEL,
             "--port", str(self.port), *flags], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.proc.stdout.read()
            try:
                if self.get("/health")["status"] == "ok":
                    break
            except OSError:
                time.sleep(0.3)
        else:
            self.proc.kill()
            raise TimeoutError("the server did not answer /health within 120 s")
        self.client = openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0, timeout=120)

    def get(self, path: str) -> dict:
        with urllib.request.urlopen(self.url + path, timeout=10) as response:
            return json.loads(response.read())

    def post(self, path: str, body: bytes | dict) -> tuple[int, dict]:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        request = urllib.request.Request(self.url + path, data=data, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=60) as response:
                return response.status, json.loads(response.read())
        except urllib.error.HTTPError as err:
            return err.code, json.loads(err.read())

    def stop(self, timeout: float = 60) -> tuple[int, str]:
        self.proc.send_signal(signal.SIGTERM)
        try:
            out, _ = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            out, _ = self.proc.communicate()
            raise
        return self.proc.returncode, out


@pytest.fixture(scope="module")
def server(checkpoint):
    srv = Server(checkpoint, "--max-batch", "16", "--max-context", "2048", "--chunk-steps", "4")
    yield srv
    status, log = srv.stop()
    assert status == 0, log[-3000:]
    assert "Traceback" not in log, log[-3000:]


def _reference(model, prompt_ids, max_tokens, **kwargs) -> str:
    config, params, tokenizer = model
    out = jaxkv.generate(params, config, [prompt_ids], max_new_tokens=max_tokens, **kwargs)
    return tokenizer.decode(out.tokens[0]), len(out.tokens[0])


def _paris_kwargs():
    return dict(method="pariskv", method_config=ParisKVConfig(**PARIS["settings"]),
                cache_config=CacheConfig(**PARIS["cache"]))


def test_models_and_health(server):
    listed = server.client.models.list()
    assert [m.id for m in listed.data] == [MODEL]
    assert server.get("/health")["status"] == "ok"


def test_chat_greedy_equals_generate(server, model):
    _, _, tokenizer = model
    question = "Where is Paris?"
    answer = server.client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": question}], max_tokens=12, temperature=0)
    ids = tokenizer.encode(tokenizer.apply_chat_template(question))
    text, n = _reference(model, ids, 12)
    assert answer.choices[0].message.content == text
    assert answer.choices[0].message.role == "assistant"
    assert answer.usage.prompt_tokens == len(ids) and answer.usage.completion_tokens == n
    assert answer.choices[0].finish_reason == ("length" if n == 12 else "stop")


def test_streamed_completion_equals_generate_and_ends_with_done(server, model):
    _, _, tokenizer = model
    prompt = "The quick brown fox"
    chunks = list(server.client.completions.create(model=MODEL, prompt=prompt, max_tokens=20, temperature=0,
                                                   stream=True, stream_options={"include_usage": True}))
    text, n = _reference(model, tokenizer.encode(prompt), 20)
    streamed = "".join(c.choices[0].text for c in chunks if c.choices)
    assert streamed == text
    assert sum(1 for c in chunks if c.choices and c.choices[0].text) >= 2  # text came in pieces
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("length", "stop")
    assert chunks[-1].usage.completion_tokens == n
    # The raw stream: server-sent events ending with `data: [DONE]`.
    request = urllib.request.Request(server.url + "/v1/chat/completions", headers={"Content-Type": "application/json"},
                                     data=json.dumps({"model": MODEL, "stream": True, "max_tokens": 5,
                                                      "messages": [{"role": "user", "content": "hi"}]}).encode())
    with urllib.request.urlopen(request, timeout=60) as response:
        assert response.headers["Content-Type"].startswith("text/event-stream")
        events = [line for line in response.read().decode().split("\n\n") if line]
    assert events[-1] == "data: [DONE]" and all(e.startswith("data: ") for e in events)


def test_sparse_method_through_the_extension_field_equals_generate(server, model):
    _, _, tokenizer = model
    prompt = TEXT[:300]
    answer = server.client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0,
                                              extra_body={"jaxkv": {"method": "pariskv", **PARIS}})
    text, _ = _reference(model, tokenizer.encode(prompt), 16, **_paris_kwargs())
    assert answer.choices[0].text == text
    dense, _ = _reference(model, tokenizer.encode(prompt), 16)
    assert text != dense  # the method mattered: the server did not fall back to dense


# The sparse batch compiles ParisKV's programs for 8 rows: in the slow suite.
@pytest.mark.parametrize("sparse", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["dense", "pariskv"])
def test_concurrent_requests_are_batched_and_each_equals_its_answer_alone(server, model, sparse):
    _, _, tokenizer = model
    n = 16 if not sparse else 6
    prompts = [TEXT[7 * i: 7 * i + 20 + 9 * i] for i in range(n)]  # 20 to 155 characters
    extra = {"jaxkv": {"method": "pariskv", **PARIS}} if sparse else None
    before = server.get("/health")["batches"]

    def ask(i):
        return server.client.completions.create(model=MODEL, prompt=prompts[i], max_tokens=6 + i % 5,
                                                temperature=0, extra_body=extra)

    with concurrent.futures.ThreadPoolExecutor(n) as pool:
        answers = list(pool.map(ask, range(n)))
    batches = server.get("/health")["batches"] - before
    assert batches < n, "no two requests shared a batch"
    for i, answer in enumerate(answers):
        kwargs = _paris_kwargs() if sparse else {}
        expected, used = _reference(model, tokenizer.encode(prompts[i]), 6 + i % 5, **kwargs)
        assert answer.choices[0].text == expected, i
        assert answer.usage.completion_tokens == used


def test_stop_strings_and_seeded_sampling(server, model):
    _, _, tokenizer = model
    prompt = "Numbers:"
    free = server.client.completions.create(model=MODEL, prompt=prompt, max_tokens=20, temperature=0).choices[0].text
    stop = free[5:8]
    assert len(stop) == 3
    cut = server.client.completions.create(model=MODEL, prompt=prompt, max_tokens=20, temperature=0, stop=[stop])
    assert cut.choices[0].text == free[:free.index(stop)] and cut.choices[0].finish_reason == "stop"
    sampled = [server.client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=1.0,
                                                seed=7).choices[0].text for _ in range(2)]
    assert sampled[0] == sampled[1]


MALFORMED = [
    ("/v1/chat/completions", b"{not json", 400),
    ("/v1/chat/completions", b"[1, 2]", 400),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, 400),  # no model
    ("/v1/chat/completions", {"model": MODEL}, 400),  # no messages
    ("/v1/chat/completions", {"model": MODEL, "messages": []}, 400),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "wizard", "content": "hi"}]}, 400),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "temperature": -1}, 400),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "top_p": 0}, 400),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "n": 2}, 400),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 0}, 400),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": "many"}, 400),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "frobnicate": True}, 400),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "stop": ["a", "b", "c", "d", "e"]}, 400),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "logprobs": 3}, 400),
    ("/v1/completions", {"model": MODEL, "prompt": ""}, 400),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "jaxkv": {"method": "nope"}}, 400),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "jaxkv": {"method": "pariskv", "settings": {"topk": 3}}}, 400),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "jaxkv": {"method": "pariskv", "settings": {"top_k": "x"}}},
     400),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "jaxkv": {"cache": {"sink": -3}, "method": "pariskv"}}, 400),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2048}, 400),  # over --max-context
    ("/v1/completions", {"model": "gpt-4", "prompt": "hi"}, 404),
    ("/v1/nothing", {"model": MODEL}, 404),
]


def test_malformed_requests_get_openai_error_bodies(server):
    for path, body, status in MALFORMED:
        got, answer = server.post(path, body)
        assert got == status, (path, body, got, answer)
        error = answer["error"]
        assert error["message"] and error["type"], (body, answer)
        assert "Traceback" not in error["message"]
    status, answer = server.post("/v1/completions", {"model": MODEL, "prompt": "hi " * 1000, "max_tokens": 100})
    assert status == 400 and answer["error"]["code"] == "context_length_exceeded"
    assert "maximum context length is 2048 tokens" in answer["error"]["message"]
    with pytest.raises(openai.BadRequestError):
        server.client.completions.create(model=MODEL, prompt="hi", n=3)
    assert server.get("/health")["status"] == "ok"


@pytest.fixture(scope="module")
def busy_server(tmp_path_factory):
    """One request at a time, one waiting; no EOS token, so a request decodes all its max_tokens."""
    srv = Server(_save_tiny(tmp_path_factory.mktemp("serve") / "tiny", eos=False), "--max-batch", "1",
                 "--max-queue", "1", "--max-context", "2048", "--shutdown-grace", "2")
    yield srv
    if srv.proc.poll() is None:
        srv.proc.kill()


def test_a_disconnect_mid_stream_cancels_the_request(busy_server):
    server = busy_server
    before = server.get("/health")["cancelled"]
    request = urllib.request.Request(server.url + "/v1/completions", headers={"Content-Type": "application/json"},
                                     data=json.dumps({"model": MODEL, "prompt": "The", "stream": True,
                                                      "max_tokens": 1900, "temperature": 0}).encode())
    response = urllib.request.urlopen(request, timeout=60)
    assert response.readline().startswith(b"data: ")  # the first piece of text arrived
    response.close()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        health = server.get("/health")
        if health["cancelled"] > before and health["running"] == 0:
            break
        time.sleep(0.2)
    else:
        pytest.fail(f"the request was not cancelled: {health}")
    # The server goes on serving.
    assert server.client.completions.create(model=MODEL, prompt="The", max_tokens=3, temperature=0).choices


def test_a_full_queue_answers_503_and_sigterm_exits_cleanly(busy_server):
    """Last of the busy server's tests: it stops the server."""
    srv = busy_server
    busy = srv.client.completions.create(model=MODEL, prompt="The", max_tokens=1900, temperature=0, stream=True)
    chunks = iter(busy)
    for _ in range(3):  # decoding now (its programs compiled): the queue is empty
        next(chunks)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(srv.post, "/v1/completions", {"model": MODEL, "prompt": "A", "max_tokens": 2})
        deadline = time.monotonic() + 30
        while srv.get("/health")["waiting"] < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        status, answer = srv.post("/v1/completions", {"model": MODEL, "prompt": "B", "max_tokens": 2})
        assert status == 503 and answer["error"]["code"] == "server_overloaded", answer
        # SIGTERM with a request decoding and one waiting: the waiting one is refused, the
        # decoding one ends within the grace period, the process exits with status 0.
        status, log = srv.stop()
        assert waiting.result(timeout=30)[0] == 503
    assert status == 0, log[-3000:]
    assert "Traceback" not in log, log[-3000:]
