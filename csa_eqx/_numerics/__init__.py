"""The numerics family: how a layer rounds (``base.py``: ``AbstractNumerics``,
``ExactNumerics``), DeepSeek's inference numerics (``deepseek.py``), the low-precision formats
(``formats.py``), FP8 weights (``fp8_weight.py``) and products (``fp8_linear.py``).
"""
