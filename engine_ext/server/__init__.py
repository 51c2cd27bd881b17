"""What runs inside an inference engine: the update transaction (docs/TRANSACTION.md), its
driver (controller, pull mode, HTTP answers, typed messages) and its ranks (layout probe,
maps, in-place apply with undo, the touched-storage refresh). Engine-agnostic: the vLLM and
SGLang adapters (engine_ext.engines) plug their processes and loaders into it."""
