"""Model loading, the Llama-family forward pass and the tokenizer."""
