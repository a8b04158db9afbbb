"""Load DeepSeek-V4 / V3.2 / V4.1 attention weights (state dicts or safetensors checkpoint
folders).

State-dict keys are the HF attention module's own parameter names (``q_a_proj.weight``,
``compressor.indexer.kv_proj.weight``, …). Checkpoint folders may use those names or
DeepSeek's native ones (``layers.{i}.attn.wq_a.weight`` with ``.scale`` tile scales) and
either the HF ``config.json`` keys or DeepSeek's own inference keys (``dim``, ``n_heads``,
``window_size``, ``compress_ratios``, …). Every mismatch between config, layer and tensors is a
``ValueError`` naming the file / key / tensor with the expected and the actual value
(docs/hf.md lists them).
"""

from ._config import v4_config_from_hf as v4_config_from_hf
from ._config import v32_config_from_hf as v32_config_from_hf
from ._loaders import load_v4_attention as load_v4_attention
from ._loaders import load_v4_attention_from_safetensors as load_v4_attention_from_safetensors
from ._loaders import load_v32_attention as load_v32_attention
from ._loaders import load_v32_attention_from_safetensors as load_v32_attention_from_safetensors
from ._loaders import native_v4_name as native_v4_name
from ._loaders import native_v32_name as native_v32_name
from ._names import parameter_paths as parameter_paths
from ._names import v4_parameter_names as v4_parameter_names
from ._names import v32_parameter_names as v32_parameter_names
from ._names import v41_parameter_names as v41_parameter_names
from ._safetensors_io import SafetensorsError as SafetensorsError
from ._safetensors_io import read_safetensors as read_safetensors
from ._v41 import load_v41_attention as load_v41_attention
from ._v41 import load_v41_attention_from_safetensors as load_v41_attention_from_safetensors
from ._v41 import v41_config_from_hf as v41_config_from_hf

__all__ = [
    "SafetensorsError",
    "read_safetensors",
    "v4_config_from_hf",
    "v4_parameter_names",
    "native_v4_name",
    "load_v4_attention",
    "load_v4_attention_from_safetensors",
    "v32_config_from_hf",
    "v32_parameter_names",
    "native_v32_name",
    "load_v32_attention",
    "load_v32_attention_from_safetensors",
    "v41_config_from_hf",
    "v41_parameter_names",
    "parameter_paths",
    "load_v41_attention",
    "load_v41_attention_from_safetensors",
]
