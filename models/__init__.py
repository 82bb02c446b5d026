"""The s3req model zoo: Llama-style and MoE decoders built from QuantLinear layers."""

from ._config import (
    count_params as count_params,
    flops_per_token as flops_per_token,
    LlamaConfig as LlamaConfig,
    MoEConfig as MoEConfig,
    RopeScaling as RopeScaling,
)
from ._ffn import FFN as FFN, PAPER_FFN_SHAPES as PAPER_FFN_SHAPES
from ._hf import (
    config_from_hf as config_from_hf,
    config_to_hf as config_to_hf,
    load_hf as load_hf,
    save_hf as save_hf,
)
from ._llama import (
    Attention as Attention,
    DecoderLayer as DecoderLayer,
    Llama as Llama,
    RMSNorm as RMSNorm,
)
from ._moe import MoE as MoE, sort_by_expert as sort_by_expert
from ._presets import get_config as get_config, PRESETS as PRESETS
