"""Config models (one module per section) and the YAML loader (`stages.core.config.loader`: load_config, RunConfig).

Nothing is imported here on purpose: a stage that reads its own section (`stages.core.config.rl`) must not run the
loader and every other section's model on import, or those modules would enter its code version (its cache key).
"""
