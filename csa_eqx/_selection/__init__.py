"""The selection family: the problem and the base (``base.py``), one strategy per module
(``dense.py``, ``streaming.py``, ``gathered.py``, ``pallas.py``, ``sharded.py``), V4.1's
pre-filter (``candidates.py``) and the chooser (``auto.py``).
"""
