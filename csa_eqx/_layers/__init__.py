"""The layer kinds: their one protocol (``base.py``) and what a pipeline returns (``forward.py``),
the V4 family's attention block, parts and pipeline (``block.py``, ``parts.py``,
``v4_family.py``), V4, V4.1 (its config and parts) and V3.2. How a layer runs is
``csa_eqx._execution``; its input checks ``csa_eqx._checks``; its caches and ``extend``'s
bookkeeping ``csa_eqx._decode``; stacks of layers ``csa_eqx._stack``.
"""
