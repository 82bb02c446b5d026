"""The mixture-of-experts FFN block (work in progress)."""

import typing

import equinox as eqx


@typing.final
class MoE(eqx.Module):
    """Mixture-of-experts FFN (not yet available)."""

    def __init__(self, *args, **kwargs):
        raise NotImplementedError("MoE: coming in the next commit.")

    def forward(self, x, *, key=None):
        raise NotImplementedError
