RNG_STREAM = "s3req"
"""The Flax RNG stream the adapters draw their keys from."""
