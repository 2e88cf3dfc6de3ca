"""Real inference engines in the loop: serve an export with vLLM in its own venv and compare what
the engine measures with this project's forecast (:mod:`bebop_megatron.engines.serve_check`)."""
