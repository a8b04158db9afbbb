"""The layers: their one protocol (``base.py``), how they run (``execution.py``), the V4
family's parts and pipeline, V4, V4.1 and V3.2, caches, ``extend``'s bookkeeping and stacks.
"""
