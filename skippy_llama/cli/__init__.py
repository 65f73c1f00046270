"""Command-line surfaces: ``skippy-llama run``, ``kv-cache`` and ``package``."""
