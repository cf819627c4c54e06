"""Framework frontends: ``torch`` and ``jax`` (each imports its framework)."""
