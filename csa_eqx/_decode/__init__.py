"""Decoding: the layers' caches (``cache.py``), the chunk bookkeeping of ``extend``
(``chunks.py``) and token generation over a model's caches (``generate.py``).
"""
