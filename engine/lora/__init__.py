"""LoRA adapters over one base model: reading PEFT adapters (adapter.py), their weights in
fixed slots that every step's tokens pick from (layers.py), and which adapter sits in which
slot (registry.py). docs/lora.md is the user's side."""
