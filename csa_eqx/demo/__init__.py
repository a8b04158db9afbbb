"""The demo application: a small LM trained on an embedded retrieval task, its plots and the
``csa-eqx`` command (``train``, ``inspect``, ``bench``).

Needs the ``demo`` extra (``pip install 'csa_eqx[demo]'``: optax, matplotlib); the attention
library itself (``import csa_eqx``) does not import this subpackage.
"""
