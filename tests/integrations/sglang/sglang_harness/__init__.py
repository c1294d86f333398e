"""Harness of the real-SGLang tests: scripts run with the SGLang venv's python
(``make setup-sglang``: ``.venv-sglang``), driven by tests/integrations/sglang/test_sglang_real.py."""
