"""orchestrator: run big Mixture-of-Experts models on llama.cpp as fast as the hardware allows."""

__version__ = "0.1.0"
