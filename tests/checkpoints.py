"""The tests' checkpoints and their oracle.

Random-weight checkpoints come from backend/models/random_checkpoint.py (made on the spot, no
download); `hf_greedy` is the correctness oracle, transformers' own `generate()`.
"""

from __future__ import annotations

import torch
import transformers

from backend.models.random_checkpoint import make_random_adapter, make_tiny_checkpoint

__all__ = ["hf_greedy", "make_random_adapter", "make_tiny_checkpoint"]


def hf_greedy(model_dir: str, prompts: list[list[int]], max_new_tokens: int, ignore_eos: bool = True,
              dtype: torch.dtype = torch.float32, adapter_dir: str | None = None) -> list[list[int]]:
    """The oracle: transformers `generate()` one prompt at a time (no padding effects);
    with `adapter_dir`, of the base model with that PEFT LoRA adapter (`PeftModel`).

    With ignore_eos=False it stops at the EOS ids of the checkpoint's generation_config.json
    (the EOS token is the last one returned).
    """
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    if adapter_dir is not None:
        import peft

        # Unmerged: PEFT adds each LoRA delta beside the base projection, as the engine does.
        model = peft.PeftModel.from_pretrained(model, adapter_dir)
    model.eval()
    outputs = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            kwargs = dict(max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0)
            if ignore_eos:
                kwargs["eos_token_id"] = None
            out = model.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
            outputs.append(out[0, ids.shape[1]:].tolist())
    return outputs
