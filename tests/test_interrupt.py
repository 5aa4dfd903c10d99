"""Nothing half-written: writers interrupted (Ctrl-C, SIGTERM), failing, or killed outright.

The real `jaxkv convert` of the embedded SmolLM2 GGUF is interrupted at several moments
(while the GGUF loads, while orbax writes the arrays, twice in a row, by SIGTERM): each
run must print one line, exit 130 (143 for SIGTERM) and leave neither the target nor a
staging directory. A writer killed with SIGKILL leaves its staging directory, which the
next write to the same target removes with a warning; a live writer's is never touched.
"""
import os
import pathlib
import signal
import subprocess
import sys
import textwrap
import threading
import time

import jax
import pytest

import models
from helpers_tiny_models import tiny_config
from models import files

ENV = {**os.environ, "JAX_PLATFORMS": "cpu"}
ENV.pop("JAXKV_DEBUG", None)
ROOT = pathlib.Path(__file__).resolve().parents[1]


class Convert:
    """A real `jaxkv convert GGUF dir/out` process whose stderr is collected as it comes."""

    def __init__(self, directory: pathlib.Path):
        self.directory = directory
        self.process = subprocess.Popen([sys.executable, "-m", "jaxkv.cli", "convert",
                                         str(models.default_model_path()), str(directory / "out")],
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV, cwd=ROOT)
        self.stderr = ""
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self):
        for chunk in iter(lambda: self.process.stderr.read(1), ""):
            self.stderr += chunk

    def loading(self) -> bool:
        return "converting" in self.stderr  # the GGUF tensors' progress bar has started

    def writing(self) -> bool:
        return any(self.directory.glob(".out.partial-*"))

    def finish(self) -> tuple[int, list[str]]:
        self.process.wait(timeout=600)
        self._reader.join(timeout=60)
        frames = (line.split("\r")[-1].strip() for line in self.stderr.split("\n"))
        return self.process.returncode, [f for f in frames if f and not f.startswith("converting ")]


# (moment, signals sent then, expected status and line)
MOMENTS = [
    ("loading", (signal.SIGINT,), 130, "jaxkv: interrupted"),
    ("writing", (signal.SIGINT, signal.SIGINT), 130, "jaxkv: interrupted"),  # Ctrl-C pressed twice
    ("writing", (signal.SIGTERM,), 143, "jaxkv: terminated"),
]


def test_interrupted_convert_leaves_nothing(tmp_path):
    """The runs share the machine (one process per moment, started together, each signalled at its moment)."""
    models.default_model_path()  # the embedded model is installed (raises with the install command if not)
    runs = []
    for i, moment in enumerate(MOMENTS):
        (tmp_path / str(i)).mkdir()
        runs.append((Convert(tmp_path / str(i)), *moment))
    pending = list(runs)
    deadline = time.monotonic() + 600
    while pending and time.monotonic() < deadline:
        for run in list(pending):
            convert, moment, signals = run[:3]
            assert convert.process.poll() is None, f"the convert ended before the {moment} moment: {convert.stderr}"
            if getattr(convert, moment)():
                for signum in signals:
                    convert.process.send_signal(signum)
                    time.sleep(0.2)
                pending.remove(run)
        time.sleep(0.02)
    assert not pending, "a moment never came"
    for convert, moment, signals, status, line in runs:
        assert convert.finish() == (status, [line]), (moment, signals, convert.stderr)
        assert list(convert.directory.iterdir()) == [], (moment, signals)


WRITER = textwrap.dedent("""
    import sys, time
    import jax, models
    from models import checkpoint
    from helpers_tiny_models import tiny_config

    save = checkpoint.ocp.StandardCheckpointer.save
    def save_then_hang(self, *args, **kwargs):
        save(self, *args, **kwargs)
        print("writing", flush=True)
        time.sleep(600)
    checkpoint.ocp.StandardCheckpointer.save = save_then_hang
    config = tiny_config()
    models.save(sys.argv[1], config, models.init_params(config, jax.random.key(0)))
""")


def test_a_killed_writers_staging_is_removed_by_the_next_write(tmp_path):
    config = tiny_config()
    params = models.init_params(config, jax.random.key(0))
    target = tmp_path / "ckpt"
    writer = subprocess.Popen([sys.executable, "-c", WRITER, str(target)], stdout=subprocess.PIPE, text=True,
                              env={**ENV, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])})
    try:
        assert writer.stdout.readline() == "writing\n"
        [staging] = files.staging_paths(target)
        with pytest.raises(FileExistsError, match=f"another process is writing {target} \\(staging at {staging}\\)"):
            models.save(target, config, params)  # a live writer's staging is not touched
        assert staging.is_dir()
    finally:
        writer.kill()
        writer.wait(timeout=60)
    with pytest.warns(models.LeftoverRemovedWarning, match=f"removed {staging}, left by an interrupted write"):
        models.save(target, config, params)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    restored_config, _ = models.restore(target)
    assert restored_config == config


def test_a_failing_write_leaves_nothing(tmp_path):
    for error in (OSError("disk full"), KeyboardInterrupt()):
        with pytest.raises(type(error)):
            with files.atomic_directory(tmp_path / "dir") as staging:
                (staging / "part").write_text("half")
                raise error
        with pytest.raises(type(error)):
            with files.atomic_file(tmp_path / "file.json") as staging:
                staging.write_text("half")
                raise error
    assert list(tmp_path.iterdir()) == []


def test_atomic_file_replaces_whole_and_keeps_the_suffix(tmp_path):
    target = tmp_path / "table.md"
    files.write_text(target, "old")
    with files.atomic_file(target) as staging:
        assert staging.suffix == ".md" and staging.name.startswith(".table.md.partial-")
        staging.write_text("new")
        assert target.read_text() == "old"  # readers see the old file until the new one is whole
    assert target.read_text() == "new" and sorted(p.name for p in tmp_path.iterdir()) == ["table.md"]


def test_atomic_directory_refuses_an_existing_target(tmp_path):
    (tmp_path / "taken").mkdir()
    with pytest.raises(FileExistsError, match="already exists"):
        with files.atomic_directory(tmp_path / "taken"):
            pass
    assert sorted(p.name for p in tmp_path.iterdir()) == ["taken"]


def test_deferred_signals_hold_ctrl_c_until_the_block_ends():
    handler = signal.getsignal(signal.SIGINT)
    assert handler is signal.default_int_handler  # Ctrl-C raises KeyboardInterrupt here
    reached_end_of_block = False
    with pytest.raises(KeyboardInterrupt):
        with files.deferred_signals():
            signal.raise_signal(signal.SIGINT)
            signal.raise_signal(signal.SIGINT)  # held once, delivered once
            reached_end_of_block = True
    assert reached_end_of_block
    assert signal.getsignal(signal.SIGINT) is handler


EXITING = textwrap.dedent("""
    import atexit, os, signal
    from jaxkv import cli
    cli.main = lambda: cli.EXIT_INTERRUPTED
    atexit.register(os.kill, os.getpid(), signal.SIGINT)  # Ctrl-C again while the interpreter exits
    cli.console_main()
""")


def test_a_second_ctrl_c_while_exiting_keeps_the_status():
    done = subprocess.run([sys.executable, "-c", EXITING], capture_output=True, text=True, env=ENV, cwd=ROOT,
                          timeout=120)
    assert (done.returncode, done.stderr) == (130, "")
