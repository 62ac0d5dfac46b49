"""One module per CLI command (see orchestrator/cli.py for the contract)."""
