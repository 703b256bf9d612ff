"""What a LoRA adapter directory holds: LlamaFactory/PEFT's files, and KT's fused expert LoRA with its
manifest. SFT publishes these, convert-lora reads and writes them."""

ADAPTER_FILES = (
    "adapter_model.safetensors", "adapter_config.json", "fused_expert_lora.safetensors", "kt_adapter_manifest.json",
)
