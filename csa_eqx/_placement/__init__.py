"""The placement family: where a layer's forward runs (``base.py``: ``AbstractPlacement``,
``SingleDevice``), head parallelism (``heads.py``) and context parallelism (``context.py``).
"""
