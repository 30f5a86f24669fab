"""Models: Flax T5 and BERT, their dual encoders, the registered model families and Hugging Face import."""
