"""The attention family: what a query reads (``reads.py``: ``Reads``), how the picks and the
sliding window are read (``picks.py``, ``window.py``), the kernel seam (``base.py``:
``AbstractAttentionKernel``) with one kernel per module (``xla.py``, the reference;
``triton.py``), the functional ``sparse_attention`` (``sparse.py``) and the chooser (``auto.py``).
"""
