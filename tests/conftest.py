import os


# Eight host CPU devices for the sharding tests (set before JAX starts its backend).
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import gc

import jax
import jax.random as jr
import pytest


jax.config.update("jax_numpy_dtype_promotion", "strict")
jax.config.update("jax_numpy_rank_promotion", "raise")


@pytest.fixture(autouse=True, scope="module")
def _release_executables_per_module():
    """Free the compiled programs of each test module when it ends.

    XLA CPU keeps every JIT-compiled code section in its own memory mapping for as long as
    its executable lives, and the compile caches keep them all alive; one process running
    many modules could otherwise reach the kernel's `vm.max_map_count` (65530) and abort
    inside LLVM ("Unable to allocate section memory")."""
    yield
    jax.clear_caches()
    gc.collect()


@pytest.fixture
def getkey():
    """A fresh key on every call, from a fixed seed (tests stay reproducible)."""
    keys = iter(jr.split(jr.key(5678), 10_000))

    def _getkey():
        return next(keys)

    return _getkey
