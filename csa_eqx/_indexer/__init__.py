"""The lightning indexer's parts: its heads (``heads.py``) and the head sharding of its
activations (``sharding.py``).
"""
