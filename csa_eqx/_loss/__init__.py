"""The indexer loss family: the KL distillation (``kl.py``), the base (``base.py``:
``AttentionTarget``, ``AbstractIndexerLoss``), one strategy per module (``dense.py``,
``streaming.py``, ``gathered.py``), the chooser (``auto.py``) and ``projected.py``.
"""
