"""huggingface_example: A Flower / Hugging Face app (Flower's quickstart-huggingface
shape, on local data and a local model)."""
