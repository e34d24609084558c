"""Lossless self-speculative decoding for Hugging Face transformers."""
