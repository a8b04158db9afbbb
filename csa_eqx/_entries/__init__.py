"""Where compressed entries come from: the compressor seam and V4's compressor
(``compressor.py``), V4.1's (``v41.py``).
"""
