"""Reading checkpoints for ``csa_eqx.hf``: configs (``config.py``), tensors (``checkpoint.py``,
``safetensors_io.py``) and V4.1's loader (``v41.py``).
"""
