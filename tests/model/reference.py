"""Greedy generation with Hugging Face transformers: the oracle for pyserve's model code."""

import torch


def hf_greedy(hf_model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """transformers' greedy continuation of one unpadded prompt, never stopping early (the
    counterpart of ignore_eos=True)."""
    ids = torch.tensor([prompt_ids])
    out = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                            min_new_tokens=None, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt_ids):].tolist()


def load_hf(path, **kwargs):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, **kwargs).eval()
    model.generation_config.eos_token_id = None
    return model
