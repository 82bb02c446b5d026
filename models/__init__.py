"""The s3req model zoo: Llama-style and MoE decoders built from QuantLinear layers."""
