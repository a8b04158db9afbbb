"""The selection family: the problem and the base (``base.py``), one strategy per module
(``dense.py``, ``streaming.py``, ``gathered.py``, ``triton.py``, ``mosaic.py`` with its kernel
``mosaic_topk.py``, ``sharded.py``; the fused kernels' row chunks in ``row_chunks.py``), V4.1's
pre-filter (``candidates.py``) and the chooser (``auto.py``).
"""
