"""Fixtures of the vLLM tests (tiny offline models, session-scoped engines): see vllm_fixtures."""

from vllm_fixtures import hf_reference, tiny_model_dirs, vllm_lm, vlm  # noqa: F401
