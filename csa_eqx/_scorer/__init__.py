"""The scorer family: the indexer's scores (``base.py``: ``indexer_scores``, ``AbstractScorer``,
``XlaScorer``), ``BlockedScorer`` (``blocked.py``) and ``PallasScorer`` (``pallas.py``).
"""
