"""Integrations with the trainers users run (each behind an extra): ``trl`` (TRL's GRPO in server
mode and AsyncGRPO, ``pip install 'engine-ext[trl]'``), ``vllm_transfer`` (vLLM's own
trainer-side weight-transfer API, ``engine-ext[vllm]``) and ``verl`` (verl's checkpoint engine
``engine_ext`` and its manager, ``engine-ext[verl]``). They sit on the trainer side: they use
the publisher and the fleet, never the server side or an engine adapter."""
