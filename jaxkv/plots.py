"""matplotlib for the studies and benchmarks that draw figures: an optional dependency (the
``plots`` extra), so a missing install is one clear error, raised before any work is done."""
from __future__ import annotations


class PlotsUnavailable(ModuleNotFoundError):
    """matplotlib is not installed: the figures need the ``plots`` extra."""


def pyplot():
    """``matplotlib.pyplot`` on the headless Agg backend; :class:`PlotsUnavailable` without matplotlib."""
    try:
        import matplotlib
    except ModuleNotFoundError as error:
        raise PlotsUnavailable("drawing figures needs matplotlib: pip install 'jaxkv[plots]' "
                               "(or pip install matplotlib)") from error
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def require() -> None:
    """Raise :class:`PlotsUnavailable` now when matplotlib is missing (a study calls this first)."""
    pyplot()
