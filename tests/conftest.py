import os


# Eight host CPU devices for the sharding tests (set before JAX starts its backend).
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax
import jax.random as jr
import pytest

from .helpers import release_executables


jax.config.update("jax_numpy_dtype_promotion", "strict")
jax.config.update("jax_numpy_rank_promotion", "raise")


@pytest.fixture(autouse=True, scope="module")
def _release_executables_per_module():
    """Free the compiled programs of each test module when it ends (see
    `helpers.release_executables`), so one process can run many modules."""
    yield
    release_executables()


@pytest.fixture
def getkey():
    """A fresh key on every call, from a fixed seed (tests stay reproducible)."""
    keys = iter(jr.split(jr.key(5678), 10_000))

    def _getkey():
        return next(keys)

    return _getkey
