"""The docs site builds strictly and documents every public name."""

import os
import pathlib
import re
import shutil
import subprocess
import sys

import pytest

import models
import policies
import s3req
import s3req.flax
import s3req.tpu
import s3req.train


ROOT = pathlib.Path(__file__).resolve().parent.parent


def _api_text() -> str:
    return "\n".join(p.read_text() for p in (ROOT / "docs" / "api").glob("*.md"))


@pytest.mark.parametrize(
    "pkg", [s3req, policies, models, s3req.train, s3req.tpu, s3req.flax], ids=lambda p: p.__name__
)
def test_every_public_name_has_an_api_entry(pkg):
    text = _api_text()
    documented = set(re.findall(r"^:::\s+([\w.]+)", text, flags=re.M))
    documented |= set(re.findall(r"^\s+:::\s+([\w.]+)", text, flags=re.M))
    missing = [
        f"{pkg.__name__}.{n}"
        for n in dir(pkg)
        if not n.startswith("_")
        and f"{pkg.__name__}.{n}" not in documented
        and not isinstance(getattr(pkg, n), type(sys))
    ]
    assert not missing, f"add to docs/api/: {missing}"


@pytest.mark.skipif(shutil.which("mkdocs") is None, reason="docs extra not installed")
def test_mkdocs_build_strict(tmp_path):
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    out = subprocess.run(
        ["mkdocs", "build", "--strict", "-q", "-d", str(tmp_path / "site")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stdout + out.stderr


# Guides whose Python blocks run top to bottom as one program (others hold long training runs
# or shell commands).
RUNNABLE_GUIDES = [
    "quickstart.md",
    "concepts.md",
    "formats.md",
    "scaling.md",
    "own-model.md",
    "reliability.md",
]


@pytest.mark.parametrize("guide", RUNNABLE_GUIDES)
def test_guide_examples_run(guide):
    text = (ROOT / "docs" / "guides" / guide).read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert blocks
    namespace: dict = {}
    with jax_standard_promotion():
        for block in blocks:
            if not block.startswith("# long-running"):
                exec(compile(block, guide, "exec"), namespace)


def jax_standard_promotion():
    """User code runs with JAX's default promotion rules, not the suite's strict ones."""
    import jax

    return jax.numpy_dtype_promotion("standard")
