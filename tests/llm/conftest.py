"""Fixtures of the vLLM tests (tiny offline models, session-scoped engines): see vllm_fixtures."""

from vllm_fixtures import hf_reference, tiny_model_dirs, vlm, vllm_lm  # noqa: F401
