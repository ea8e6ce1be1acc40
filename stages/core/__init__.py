"""Shared ground for every stage: config models, refs + fingerprints, registries, atomic IO, logging."""
