"""User errors through the real `jaxkv` command: one line on stderr, exit status 2, no traceback.

Each case is a subprocess (`python -m jaxkv.cli`), which imports JAX: the cases
are chosen to fail before the model is loaded, except one that needs the
embedded model (a request the model rejects).
"""
import json
import os
import subprocess
import sys

import pytest

from helpers_tiny_models import tiny_config, write_random_hf_checkpoint

ENV = {**os.environ, "JAX_PLATFORMS": "cpu"}
ENV.pop("JAXKV_DEBUG", None)


def run_cli(*argv: str, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "jaxkv.cli", *argv], capture_output=True, text=True,
                          env=ENV, cwd=cwd, timeout=600)


def message_lines(stderr: str) -> list[str]:
    """stderr without the loaders' progress-bar frames ("converting …: 40%|…"), which are not messages."""
    frames = (line.split("\r")[-1].strip() for line in stderr.split("\n"))
    return [line for line in frames if line and not line.startswith("converting ")]


def assert_one_line_error(result: subprocess.CompletedProcess, fragment: str) -> None:
    lines = message_lines(result.stderr)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("jaxkv: error: ") and fragment in lines[0], lines[0]


def test_empty_prompt():
    assert_one_line_error(run_cli("generate", "--prompt", "  "), "the prompt is empty")


def test_missing_prompt_file(tmp_path):
    assert_one_line_error(run_cli("generate", "--prompt-file", str(tmp_path / "absent.txt")),
                          f"cannot read prompt file {tmp_path / 'absent.txt'}: No such file or directory")


def test_missing_model(tmp_path):
    assert_one_line_error(run_cli("generate", "--prompt", "hi", "--model", str(tmp_path / "nowhere")),
                          f"no model at {tmp_path / 'nowhere'}")


def test_checkpoint_with_a_corrupt_manifest(tmp_path):
    (tmp_path / "jaxkv_checkpoint.json").write_text("{")
    assert_one_line_error(run_cli("convert", str(tmp_path), str(tmp_path / "out")),
                          "jaxkv_checkpoint.json: not valid JSON")


def test_convert_a_config_that_does_not_match_the_weights(tmp_path):
    write_random_hf_checkpoint(tmp_path, tiny_config(), hf_overrides={"intermediate_size": 48})
    assert_one_line_error(run_cli("convert", str(tmp_path), str(tmp_path / "out")),
                          "expected shape (32, 48), found (32, 64)")
    assert not (tmp_path / "out").exists()


def test_convert_onto_an_existing_directory(tmp_path):
    src = tmp_path / "src"
    write_random_hf_checkpoint(src, tiny_config())
    (tmp_path / "taken").mkdir()
    assert_one_line_error(run_cli("convert", str(src), str(tmp_path / "taken")), "already exists")


@pytest.mark.slow
def test_negative_max_new_tokens_with_the_embedded_model():
    """Loads the real model (the request is checked by generate())."""
    assert_one_line_error(run_cli("generate", "--prompt", "hi", "--max-new-tokens", "-1"),
                          "max_new_tokens must be >= 0, got -1")


@pytest.mark.slow
def test_unknown_method_parameter_with_the_embedded_model():
    assert_one_line_error(run_cli("generate", "--prompt", "hi", "--method", "pariskv", "--set", "topk=3"),
                          "ParisKVConfig has no field 'topk'")
