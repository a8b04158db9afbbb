"""The scorer family: the indexer's scores (``base.py``: ``indexer_scores``, ``AbstractScorer``,
``XlaScorer``), ``BlockedScorer`` (``blocked.py``) and ``TritonScorer`` (``triton.py``).
"""
