"""Engine adapters: vLLM (``engines.vllm``) and SGLang (``engines.sglang``), each with a
``compat.py`` holding every engine touchpoint (checked statically, ``compat.Touchpoint``),
and the patches they apply (patches/README.md). Loaded by the engines' entry points; nothing
else in engine_ext imports them."""
