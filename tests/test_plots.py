"""matplotlib is optional (the ``plots`` extra): without it, a study or the benchmark that draws a
figure stops before doing any work, with one line naming the extra."""
import contextlib
import io
import sys

import pytest

from jaxkv import cli, plots


@pytest.fixture
def no_matplotlib(monkeypatch):
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` now raises ModuleNotFoundError


def test_pyplot_names_the_extra_when_matplotlib_is_missing(no_matplotlib):
    with pytest.raises(plots.PlotsUnavailable, match=r"pip install 'jaxkv\[plots\]'"):
        plots.pyplot()


@pytest.mark.parametrize("argv", [
    ["eval", "attention-error", "--capture-cache", "no-such-file.npz"],
    ["eval", "hybrid"],
    ["eval", "recall"],
    ["eval", "drift"],
    ["bench", "--quick"],
])
def test_a_command_that_draws_stops_first_with_one_line(no_matplotlib, monkeypatch, argv):
    monkeypatch.delenv("JAXKV_DEBUG", raising=False)
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        status = cli.main(argv)
    assert status == cli.EXIT_RUNTIME  # a valid command; the environment lacks an extra
    assert err.getvalue().strip() == ("jaxkv: error: drawing figures needs matplotlib: pip install 'jaxkv[plots]' "
                                      "(or pip install matplotlib)")


def test_pyplot_draws_headless():
    plt = plots.pyplot()
    import matplotlib

    assert matplotlib.get_backend().lower() == "agg"
    plt.close(plt.figure())
