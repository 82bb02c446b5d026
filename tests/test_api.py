"""Public API hygiene: every class abstract or final, every public name documented."""

import inspect

import equinox as eqx
import pytest

import models
import policies
import s3req


PACKAGES = [s3req, policies, models]


def _public(pkg):
    return [(n, getattr(pkg, n)) for n in dir(pkg) if not n.startswith("_")]


def _is_final(cls) -> bool:
    return getattr(cls, "__final__", False)


@pytest.mark.parametrize("pkg", PACKAGES, ids=lambda p: p.__name__)
def test_modules_abstract_or_final(pkg):
    for name, obj in _public(pkg):
        if inspect.isclass(obj) and issubclass(obj, eqx.Module):
            abstract = name.startswith("Abstract") or inspect.isabstract(obj)
            assert abstract or _is_final(obj), f"{pkg.__name__}.{name} is neither"
            if abstract:
                assert name.startswith("Abstract"), name


@pytest.mark.parametrize("pkg", PACKAGES, ids=lambda p: p.__name__)
def test_public_names_documented(pkg):
    for name, obj in _public(pkg):
        if inspect.ismodule(obj) or not (inspect.isclass(obj) or callable(obj)):
            continue
        assert inspect.getdoc(obj), f"{pkg.__name__}.{name} has no docstring"


def test_presets():
    assert policies.preset("bf16") is None
    assert policies.preset("s3r-ec-2way") == policies.Policy(policies.Phi2D(), policies.TwoWayEC())
    with pytest.raises(ValueError, match="Unknown policy"):
        policies.preset("s4r")
    with pytest.raises(ValueError, match="round-to-nearest"):
        policies.Policy(policies.Nearest(), policies.TwoWayEC())
    with pytest.raises(TypeError):
        policies.Policy("phi2d")  # pyright: ignore
    assert hash(policies.Policy(policies.Phi2D())) == hash(policies.Policy(policies.Phi2D()))


def test_abstract_cannot_instantiate():
    with pytest.raises(TypeError):
        s3req.AbstractTopology()  # pyright: ignore
