"""LoRA: dense and grouped-by-expert adapters, injection, merging, PEFT export/import (DESIGN.md §5)."""

from .inject import cast_frozen_, inject_lora, lora_modules, lora_state_dict, merge_lora
from .layers import GroupedLoRALinear, LoRALinear
from .peft import export_peft, load_peft, read_adapter_config

__all__ = ["GroupedLoRALinear", "cast_frozen_", "LoRALinear", "export_peft", "inject_lora", "load_peft", "lora_modules",
           "lora_state_dict", "merge_lora", "read_adapter_config"]
