"""Export a trained model and its index as one TensorFlow SavedModel for serving (`t5r export`)."""
