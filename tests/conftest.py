"""Shared test configuration: float32 on CPU and bounded hypothesis profiles."""
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The CLI's persistent compilation cache stays out of the user's home during tests.
os.environ.setdefault("JAXKV_COMPILATION_CACHE", "off")

from hypothesis import HealthCheck, settings

# The default profile keeps the suite within minutes on 2 cores; `long` is for
# an occasional deep run: pytest --hypothesis-profile=long
settings.register_profile(
    "default", max_examples=20, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "long", max_examples=500, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))
