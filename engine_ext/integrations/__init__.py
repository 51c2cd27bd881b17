"""Integrations with the trainers users run (each behind an extra): ``trl`` (TRL's GRPO in server
mode and AsyncGRPO, ``pip install 'engine-ext[trl]'``). They sit on the trainer side: they use the
publisher and the fleet, never the server side or an engine adapter."""
