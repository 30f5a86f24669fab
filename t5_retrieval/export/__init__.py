"""Export a trained model: one TensorFlow SavedModel with its index (`t5r export`), or a Hugging Face
directory (`t5r export-hf`)."""
