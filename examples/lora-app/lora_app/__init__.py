"""lora_app: LoRA fine-tuning of a small Llama with Flower and Sky (split-model training)."""
