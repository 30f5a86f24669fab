"""Models: Flax T5, the ST5 dual encoder, and Hugging Face checkpoint import."""
