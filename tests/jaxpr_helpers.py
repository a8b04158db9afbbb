"""Walks over a jaxpr and every jaxpr nested in it (scan, while, cond, pjit, custom_vjp,
checkpoint), shared by the tests that check which path was traced and what it holds."""

from jax.extend.core import jaxprs_in_params


def walk_eqns(jaxpr):
    """Every equation of ``jaxpr`` and of the jaxprs nested in it."""
    for eqn in jaxpr.eqns:
        yield eqn
        for sub in jaxprs_in_params(eqn.params):
            yield from walk_eqns(sub)


def walk_avals(jaxpr):
    """The abstract value of every equation output, nested jaxprs included."""
    for eqn in walk_eqns(jaxpr):
        for v in eqn.outvars:
            yield v.aval


def primitives(jaxpr) -> set[str]:
    """Names of the primitives used anywhere in ``jaxpr``."""
    return {eqn.primitive.name for eqn in walk_eqns(jaxpr)}
