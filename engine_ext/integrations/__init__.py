"""Integrations with the trainers users run (each behind an extra): ``trl`` (TRL's GRPO in server
mode and AsyncGRPO, ``pip install 'engine-ext[trl]'``) and ``vllm_transfer`` (vLLM's own
trainer-side weight-transfer API, ``engine-ext[vllm]``). They sit on the trainer side: they use
the publisher and the fleet, never the server side or an engine adapter."""
