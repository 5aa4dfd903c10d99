"""Failures of the `jaxkv` command: one `jaxkv: error:` line, exit 2 (usage) or 1 (runtime), no traceback.

Usage errors (a flag or its value, a path that names nothing) are found before any
model is loaded; runtime errors (a file that cannot be used, a request that cannot fit)
while the command works. Most cases run `cli.main` in this process on a tiny model (cheap);
a few run the real command in a subprocess, where a traceback or a second line would show.
"""
import json
import os
import pathlib
import subprocess
import sys

import jax
import numpy as np
import pytest
import tokenizers

import models
from helpers_tiny_models import tiny_config, write_random_hf_checkpoint
from jaxkv import cli
from jaxkv.attention import magicpig, topk
from jaxkv.eval import capture as capture_mod
from jaxkv.eval import ruler_runner

ENV = {**os.environ, "JAX_PLATFORMS": "cpu"}
ENV.pop("JAXKV_DEBUG", None)
CONFIG = tiny_config()


def message_lines(stderr: str) -> list[str]:
    """stderr without the loaders' progress-bar frames ("converting …: 40%|…"), which are not messages."""
    frames = (line.split("\r")[-1].strip() for line in stderr.split("\n"))
    return [line for line in frames if line and not line.startswith("converting ")]


def run(capsys, *argv: str) -> tuple[int, list[str]]:
    """(exit status, stderr message lines) of `jaxkv argv` run in this process."""
    try:
        status = cli.main(list(argv))
    except SystemExit as exit_:  # argparse
        status = exit_.code
    return status, message_lines(capsys.readouterr().err)


def assert_one_line_error(result: tuple[int, list[str]], status: int, fragment: str) -> None:
    got_status, lines = result
    assert got_status == status and len(lines) == 1, (got_status, lines)
    assert lines[0].startswith("jaxkv: error: ") and fragment in lines[0], lines[0]


@pytest.fixture(autouse=True)
def _no_debug(monkeypatch):
    monkeypatch.delenv("JAXKV_DEBUG", raising=False)


@pytest.fixture(scope="module")
def checkpoint_dir(tmp_path_factory):
    """The tiny model saved with a character-level tokenizer (ids 0..7 of its 128)."""
    tokenizer = models.Tokenizer(tokenizers.Tokenizer(tokenizers.models.BPE(
        vocab={c: i for i, c in enumerate("abcdefgh")}, merges=[])))
    path = tmp_path_factory.mktemp("cli") / "tiny"
    models.save(path, CONFIG, models.init_params(CONFIG, jax.random.key(0)), tokenizer)
    return path


# ---------------------------------------------------------------- usage errors (exit 2), before any load

@pytest.mark.parametrize("argv, fragment", [
    (["generate", "--prompt", "hi", "--max-new-tokens", "abc"], "argument --max-new-tokens: must be an int >= 1"),
    (["generate", "--prompt", "hi", "--max-new-tokens", "0"], "argument --max-new-tokens: must be >= 1, got '0'"),
    (["generate", "--prompt", "hi", "--seed", str(2**64)], "argument --seed: must be in [0, 4294967295]"),
    (["generate", "--prompt", "hi", "--seed", "-1"], "argument --seed: must be in [0, 4294967295], got '-1'"),
    (["generate", "--prompt", "hi", "--temperature", "nan"], "argument --temperature: must be a finite number >= 0"),
    (["generate", "--prompt", "hi", "--temperature", "-1"], "argument --temperature: must be >= 0, got '-1'"),
    (["generate", "--prompt", "hi", "--temperature", "1e-9"], "must be 0 (greedy) or >= 1e-06"),
    (["generate", "--prompt", "hi", "--top-p", "1.5"], "argument --top-p: must be in (0, 1], got '1.5'"),
    (["generate", "--prompt", "hi", "--top-k", "0"], "argument --top-k: must be >= 1, got '0'"),
    (["generate", "--prompt", "hi", "--top-k", "5", "--top-p", "0.5"],
     "--top-k, --top-p: sampling filters need --temperature > 0 (0 is greedy decoding)"),
    (["generate", "--prompt", "hi", "--method", "magicpig", "--sink", "-1"], "argument --sink: must be >= 0"),
    (["generate", "--prompt", "hi", "--method", "magicpig", "--buffer", "0"], "argument --buffer: must be >= 1"),
    (["generate", "--prompt", "hi", "--method", "nosuch"], "argument --method: invalid choice: 'nosuch'"),
    (["generate", "--prompt", "hi", "--frobnicate"], "unrecognized arguments: --frobnicate"),
    (["generate"], "one of the arguments --prompt --prompt-file is required"),
    ([], "jaxkv: error: the following arguments are required: command (see --help)"),
    (["eval", "recall", "--tokens", "0"], "jaxkv: error: eval recall: argument --tokens: must be >= 1, got '0'"),
    (["generate", "--prompt", "  "], "the prompt is empty"),
    (["generate", "--prompt", "hi", "--model", ""], "--model is empty: give a model path"),
    (["generate", "--prompt", "hi", "--model", "no/such/model"], "no model at no/such/model"),
    (["generate", "--prompt", "hi", "--sink", "4"], "--sink: the cache-region flags apply to the sparse methods"),
    (["generate", "--prompt", "hi", "--on-device", "--no-dense-fallback"],
     "--no-dense-fallback, --on-device: the cache-region flags apply to the sparse methods"),
    (["generate", "--prompt", "hi", "--method", "pariskv", "--set", "topk=3"], "ParisKVConfig has no field 'topk'"),
    (["generate", "--prompt", "hi", "--method", "pariskv", "--set", "top_k"], "--set expects key=value, got 'top_k'"),
    (["generate", "--prompt", "hi", "--method", "topk", "--set", "top_k=2.5"],
     "--set top_k: cannot read '2.5' as an int"),
    (["generate", "--prompt", "hi", "--method", "magicpig", "--set", "candidate_capacity=inf"],
     "MagicPIGConfig.candidate_capacity must be an int or a finite number, got inf"),
    (["generate", "--prompt", "hi", "--method", "magicpig", "--set", "K=40"], "MagicPIGConfig.K must be in [1, 16]"),
    (["generate", "--prompt", "hi", "--method", "magicpig", "--set", "dense_layers=0,x"],
     "--set dense_layers: cannot read '0,x' as a sequence of ints"),
    (["convert", "no/such/model.gguf", "out"], "no model at no/such/model.gguf"),
    (["convert", "", "out"], "SRC is empty"),
    (["eval", "recall", "--layers", "a,b"], "--layers must be 'all' or comma-separated layer numbers >= 0"),
    (["eval", "attention-error", "--tokens", "10", "--queries", "20"], "--queries 20 must be at most --tokens 10"),
    (["eval", "attention-error", "--budgets", "0.5,2"], "--budgets must lie in (0, 1]"),
    (["eval", "drift", "--tokens", "100", "--prefill", "200"], "--prefill 200 must be below --tokens 100"),
    (["eval", "drift", "--tokens", "5000", "--prefill", "600"], "--prefill 600 leaves a pool of 84 keys"),
    (["eval", "hybrid", "--sweep-layers", "1,-2"], "--sweep-layers must be 'all' or comma-separated"),
    (["eval", "ruler", "--lengths", "2048,x"], "--lengths must be comma-separated ints"),
    (["eval", "ruler", "--methods", "nosuch"], "--methods: unknown label(s) ['nosuch']"),
    (["eval", "ruler", "--merge", "no/such.json"], "--merge: no file no/such.json"),
    (["eval", "recall", "--model", "no/such/model"], "no model at no/such/model"),
])
def test_usage_errors(capsys, argv, fragment):
    assert_one_line_error(run(capsys, *argv), 2, fragment)


def test_prompt_files(capsys, tmp_path):
    assert_one_line_error(run(capsys, "generate", "--prompt-file", str(tmp_path / "absent.txt")), 2,
                          f"cannot read prompt file {tmp_path / 'absent.txt'}: No such file or directory")
    (tmp_path / "latin1.txt").write_bytes("café".encode("latin-1"))
    assert_one_line_error(run(capsys, "generate", "--prompt-file", str(tmp_path / "latin1.txt")), 2,
                          f"prompt file {tmp_path / 'latin1.txt'} is not UTF-8 text")
    assert_one_line_error(run(capsys, "generate", "--prompt-file", str(tmp_path)), 2,
                          f"cannot read prompt file {tmp_path}: Is a directory")


def test_study_output_must_be_a_directory(capsys, tmp_path):
    (tmp_path / "file").write_text("")
    assert_one_line_error(run(capsys, "eval", "recall", "--out", str(tmp_path / "file")), 2,
                          f"--out {tmp_path / 'file'} is a file; give a directory for the study's outputs")


def test_convert_onto_an_existing_path_is_refused_before_loading(capsys, tmp_path, monkeypatch):
    write_random_hf_checkpoint(tmp_path / "src", CONFIG)
    (tmp_path / "taken").mkdir()
    monkeypatch.setattr(models.ModelSource, "load", lambda *a, **k: pytest.fail("the model was loaded"))
    assert_one_line_error(run(capsys, "convert", str(tmp_path / "src"), str(tmp_path / "taken")), 2,
                          "already exists; choose a new path or remove it")


@pytest.mark.parametrize("text, expected", [
    ("0,16", (0, 16)), ("(0, 16)", (0, 16)), ("[0,16]", (0, 16)), ("7", (7,)), ("", ())])
@pytest.mark.parametrize("cls", [magicpig.MagicPIGConfig, topk.TopKConfig])
def test_set_reads_a_tuple_of_layers(cls, text, expected):
    """--set dense_layers=... for MagicPIG and TopK (tuple[int, ...] fields), in every spelling."""
    assert cli.config_with_overrides(cls, [f"dense_layers={text}"]).dense_layers == expected


def test_set_reads_every_field_kind():
    cfg = cli.config_with_overrides(magicpig.MagicPIGConfig, ["capacity=64", "candidate_capacity=0.25",
                                                                "center=false", "kernels=xla"])
    assert (cfg.capacity, cfg.candidate_capacity, cfg.center, cfg.kernels) == (64, 0.25, False, "xla")


def test_flags_are_checked_before_the_model_loads(capsys, monkeypatch):
    monkeypatch.setattr(models, "open_model", lambda *a, **k: pytest.fail("the model was opened"))
    assert_one_line_error(run(capsys, "generate", "--prompt", "hi", "--method", "magicpig", "--set", "L=1"), 2,
                          "MagicPIGConfig.L must be >= 2, got 1")


def test_keep_quantized_needs_a_gguf_model(capsys, checkpoint_dir):
    assert_one_line_error(run(capsys, "generate", "--prompt", "abc", "--model", str(checkpoint_dir),
                              "--keep-quantized"), 2,
                          f"--keep-quantized applies to GGUF models; {checkpoint_dir} is a checkpoint model")


def test_beyond_the_context_names_the_flags(capsys, checkpoint_dir, monkeypatch):
    monkeypatch.setattr(models.ModelSource, "load", lambda *a, **k: pytest.fail("the weights were loaded"))
    assert_one_line_error(run(capsys, "generate", "--prompt", "abc", "--model", str(checkpoint_dir),
                              "--max-new-tokens", "300"), 2,
                          "the prompt (3 tokens) + --max-new-tokens 300 = 303 positions exceed the model's context "
                          "of 256 (max_position_embeddings); lower --max-new-tokens or pass --allow-beyond-context")


# ---------------------------------------------------------------- runtime errors (exit 1)

def test_a_request_that_cannot_fit_is_refused_before_the_weights_load(capsys, checkpoint_dir, monkeypatch):
    monkeypatch.setattr(models.ModelSource, "load", lambda *a, **k: pytest.fail("the weights were loaded"))
    status, lines = run(capsys, "generate", "--prompt", "abc", "--model", str(checkpoint_dir),
                        "--max-new-tokens", str(10**9), "--allow-beyond-context")
    assert_one_line_error((status, lines), 1, "the request's KV cache needs ")
    assert "1000000003 positions" in lines[0] and " is available" in lines[0]


def test_a_model_without_a_tokenizer(capsys, tmp_path):
    write_random_hf_checkpoint(tmp_path, CONFIG)
    assert_one_line_error(run(capsys, "generate", "--prompt", "hi", "--model", str(tmp_path)), 1,
                          f"the model at {tmp_path} has no tokenizer (a Hugging Face directory without "
                          "tokenizer.json, or a checkpoint saved without one); a text prompt needs one")


def test_an_impossible_config_names_the_file_and_key(capsys, tmp_path):
    write_random_hf_checkpoint(tmp_path, CONFIG, hf_overrides={"num_attention_heads": 0})
    assert_one_line_error(run(capsys, "convert", str(tmp_path), str(tmp_path / "out")), 1,
                          f"{tmp_path / 'config.json'}: config key 'num_attention_heads' must be > 0, got 0")


def test_a_damaged_checkpoint_names_the_file(capsys, checkpoint_dir, tmp_path):
    import shutil

    damaged = tmp_path / "damaged"
    shutil.copytree(checkpoint_dir, damaged)
    (damaged / "params" / "_METADATA").unlink()
    assert_one_line_error(run(capsys, "generate", "--prompt", "abc", "--model", str(damaged)), 1,
                          f"{damaged / 'params' / '_METADATA'}: missing (the checkpoint is damaged)")


def test_a_damaged_capture_cache_and_merge_file(capsys, tmp_path):
    (tmp_path / "cut.npz").write_bytes(b"PK\x03\x04 not a whole zip")
    assert_one_line_error(run(capsys, "eval", "recall", "--capture-cache", str(tmp_path / "cut.npz")), 1,
                          f"{tmp_path / 'cut.npz'}: not a readable capture cache, truncated or not an .npz file")
    (tmp_path / "merge.json").write_text(json.dumps({"records": [{"task": "x"}]}))
    assert_one_line_error(run(capsys, "eval", "ruler", "--merge", str(tmp_path / "merge.json")), 1,
                          f"{tmp_path / 'merge.json'}: record 0 is not a ruler record")
    (tmp_path / "bad.json").write_text("{")
    assert_one_line_error(run(capsys, "eval", "ruler", "--merge", str(tmp_path / "bad.json")), 1,
                          f"{tmp_path / 'bad.json'}: not valid JSON")


def _raise(error):
    def raiser(*args, **kwargs):
        raise error
    return raiser


def test_an_unexpected_exception_is_one_line_and_debug_shows_it(capsys, monkeypatch):
    monkeypatch.setattr(cli, "_model_source", _raise(RuntimeError("something broke\nsecond line")))
    assert_one_line_error(run(capsys, "convert", "a", "b"), 1,
                          "RuntimeError: something broke (run with --debug for the traceback)")
    with pytest.raises(RuntimeError, match="something broke"):
        cli.main(["convert", "a", "b", "--debug"])
    with pytest.raises(RuntimeError, match="something broke"):
        cli.main(["--debug", "convert", "a", "b"])


@pytest.mark.parametrize("error, status, line", [(KeyboardInterrupt, 130, "jaxkv: interrupted"),
                                                 (cli.Terminated, 143, "jaxkv: terminated")])
def test_interruptions_are_one_line(capsys, monkeypatch, error, status, line):
    monkeypatch.setattr(cli, "_model_source", _raise(error()))
    assert run(capsys, "convert", "a", "b") == (status, [line])


def test_a_leftover_staging_directory_is_reported_in_one_line(capsys, tmp_path):
    write_random_hf_checkpoint(tmp_path / "src", CONFIG)
    leftover = tmp_path / ".out.partial-0123456789ab"
    (leftover / "params").mkdir(parents=True)
    status, lines = run(capsys, "convert", str(tmp_path / "src"), str(tmp_path / "out"))
    assert status == 0 and lines == [f"jaxkv: warning: removed {leftover}, left by an interrupted write of "
                                     f"{tmp_path / 'out'}"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "src"]


def test_ruler_merge_input_checks(tmp_path):
    """The merge refuses a part that is not a result, or a record of the wrong shape, naming the file."""
    (tmp_path / "list.json").write_text("[1]")
    with pytest.raises(ValueError, match=r"list\.json has no 'records' list"):
        ruler_runner.load_records(tmp_path / "list.json")
    record = dict(task="niah", length=2048, seed=0, method="dense", score=1.0, keys_read_fraction=None,
                  answer="a", references=["a"], prompt_tokens=10)
    (tmp_path / "ok.json").write_text(json.dumps({"records": [record]}))
    assert ruler_runner.load_records(tmp_path / "ok.json")[1][0].references == ("a",)
    (tmp_path / "bad.json").write_text(json.dumps({"records": [record, {**record, "length": "2048"}]}))
    with pytest.raises(ValueError, match=r"bad\.json: record 1: Record\.length must be an int >= 1, got '2048'"):
        ruler_runner.load_records(tmp_path / "bad.json")


@pytest.mark.parametrize("arrays, pattern", [
    (dict(a=np.zeros(3)), r"a capture cache holds the arrays \['keys', 'values', 'queries', 'query_positions'\]"),
    (dict(keys=np.zeros((2, 1, 10, 8)), values=np.zeros((2, 1, 10, 4)), queries=np.zeros((2, 1, 3, 4, 8)),
          query_positions=np.arange(6, 10)), r"keys \(2, 1, 10, 8\) and values \(2, 1, 10, 4\) must both be"),
    (dict(keys=np.zeros((2, 1, 10, 8)), values=np.zeros((2, 1, 10, 8)), queries=np.zeros((2, 1, 3, 4, 8)),
          query_positions=np.arange(8, 12)), r"query_positions must increase within \[0, 10\)"),
    (dict(keys=np.full((2, 1, 10, 8), np.nan), values=np.zeros((2, 1, 10, 8)), queries=np.zeros((2, 1, 3, 4, 8)),
          query_positions=np.arange(6, 10)), r"keys must be finite floats"),
])
def test_capture_cache_checks(tmp_path, arrays, pattern):
    np.savez(tmp_path / "c.npz", **arrays)
    with pytest.raises(ValueError, match=r"c\.npz: " + pattern):
        capture_mod.read_capture(tmp_path / "c.npz")


# ---------------------------------------------------------------- the real command, in a subprocess

def run_process(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "jaxkv.cli", *argv], capture_output=True, text=True,
                          env=ENV, timeout=600, cwd=pathlib.Path(__file__).resolve().parents[1])


def test_a_usage_error_in_a_real_process():
    result = run_process("generate", "--prompt", "hi", "--max-new-tokens", "abc")
    assert result.returncode == 2 and "Traceback" not in result.stderr and "usage:" not in result.stderr
    assert message_lines(result.stderr) == [
        "jaxkv: error: generate: argument --max-new-tokens: must be an int >= 1, got 'abc' (see --help)"]


def test_a_runtime_error_in_a_real_process(checkpoint_dir, tmp_path):
    import shutil

    damaged = tmp_path / "damaged"
    shutil.copytree(checkpoint_dir, damaged)
    victim = max((f for f in (damaged / "params").rglob("*") if f.is_file()), key=lambda f: f.stat().st_size)
    victim.write_bytes(victim.read_bytes()[:10])
    result = run_process("generate", "--prompt", "abc", "--model", str(damaged))
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    lines = message_lines(result.stderr)
    assert len(lines) == 1 and lines[0].startswith(f"jaxkv: error: {victim}: 10 bytes where the manifest records")
