"""`jaxkv bench` runs jaxkv.bench.attention, code of the installed package; the script in
benchmarks/ is an entry point to the same code."""
import contextlib
import io
import pathlib
import subprocess
import sys

from jaxkv import cli
from jaxkv.bench import attention

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _help(argv) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
        cli.main(argv)
    return out.getvalue()


def test_jaxkv_bench_parses_with_the_package_benchmark():
    text = _help(["bench", "--help"])
    assert "--quick" in text and "--loop-steps" in text
    for name in attention.DEFAULT_METHODS:  # the methods the package module offers
        assert name in text
    assert pathlib.Path(attention.__file__).is_relative_to(ROOT / "jaxkv")


def test_the_benchmarks_script_runs_the_package_module():
    script = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_attention.py"), "--help"],
                            capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert script.returncode == 0, script.stderr[-2000:]
    assert script.stdout == _help(["bench", "--help"])  # the same parser
