"""The attention kernel seam: what a query reads is a typed value (``csa_eqx.Reads``); a
kernel computes one softmax over it. ``csa_eqx.XlaAttention`` is the reference; a Pallas or
quantised kernel is one new subclass, selected with ``Execution(attention=...)``."""

from __future__ import annotations

import abc

import equinox as eqx
from jaxtyping import Array, Float

from .reads import Reads

__all__ = ["AbstractAttentionKernel"]


class AbstractAttentionKernel(eqx.Module):
    """Softmax attention of each query over its ``Reads`` (keys shared across heads), with an
    optional per-head sink in the denominator.

    The contract every kernel keeps (the reference's tests check it): a query with no visible
    key (and no sink) returns zeros and ``lse = -inf``; key / value rows holding a NaN or an
    Inf reach exactly the queries that read them (and those whose own query is non-finite),
    which return NaN, every other query is unaffected; the output is in ``q``'s dtype, the
    ``lse`` float32 (the output rounded to it: ``round_to``).
    """

    @abc.abstractmethod
    def attend(
        self,
        q: Float[Array, "batch seq heads dim"],
        reads: Reads,
        sinks: Float[Array, " heads"] | None,
        scale: float,
        *,
        return_lse: bool = False,
        query_block: int,
        numerics=None,
    ) -> (
        Float[Array, "batch seq heads vdim"]
        | tuple[Float[Array, "batch seq heads vdim"], Float[Array, "batch seq heads"]]
    ):
        """**Arguments:**

        - ``q``: queries ``[B, S, H, d]``.
        - ``reads``: what each query reads (``csa_eqx.Reads``, at least one key set).
        - ``sinks``: per-head sink logits ``[H]`` (denominator only), or ``None``.
        - ``scale``: softmax scale.
        - ``return_lse``: also return each head's float32 log-normaliser (sink included).
        - ``query_block``: queries per block (``>= 1``; ``Execution.attend`` resolves it with
            ``csa_eqx._auto.attention_query_block``); a kernel may ignore it.
        - ``numerics``: the layer's ``AbstractNumerics`` (``None``: the exact softmax): the
            maximum the exponentials are relative to (``attention_max``) and the weights of
            the values (``attention_weights``); a kernel that cannot take them refuses numerics
            whose ``exact_softmax`` is false.

        **Returns:**

        ``[B, S, H, vdim]`` in ``q``'s dtype; with ``return_lse``, ``(out, lse)`` with
        ``lse [B, S, H]``.
        """
