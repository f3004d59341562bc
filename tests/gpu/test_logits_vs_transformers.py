"""exllamav2 with exlq's paged attention computes the same logits as transformers.

Random weights make greedy text fragile, so logits are the fair comparison: at prefill
(the last prompt position) and over 32 decode steps fed the same tokens.
"""

from __future__ import annotations

from pathlib import Path

PROMPT_TOKENS = 200
DECODE_STEPS = 32


def exllamav2_logits(model_dir: Path, prompt: list[int]) -> tuple[list[int], object]:
    import torch
    from exllamav2 import ExLlamaV2, ExLlamaV2Cache, ExLlamaV2Config, ExLlamaV2Tokenizer
    from exllamav2.generator import (
        ExLlamaV2DynamicGenerator,
        ExLlamaV2DynamicJob,
        ExLlamaV2Sampler,
    )

    from exlq.worker.engines.exllamav2.attention import install_attention

    assert install_attention("exlq") == "exlq"
    config = ExLlamaV2Config(str(model_dir))
    model = ExLlamaV2(config)
    cache = ExLlamaV2Cache(model, max_seq_len=4096, lazy=True)
    model.load_autosplit(cache, progress=False)
    generator = ExLlamaV2DynamicGenerator(model, cache, ExLlamaV2Tokenizer(config), paged=True)
    generator.enqueue(
        ExLlamaV2DynamicJob(
            input_ids=torch.tensor([prompt]),
            max_new_tokens=DECODE_STEPS,
            stop_conditions=[],
            gen_settings=ExLlamaV2Sampler.Settings.greedy(),
            return_logits=True,
        )
    )
    tokens: list[int] = []
    logits = []
    while generator.num_remaining_jobs():
        for result in generator.iterate():
            if result.get("stage") == "streaming" and "token_ids" in result:
                tokens += result["token_ids"].flatten().tolist()
                logits.append(result["logits"][0].float().cpu())
    model.unload()
    return tokens, torch.cat(logits)[:, : config.vocab_size]


def test_logits_match_transformers_at_prefill_and_32_decode_steps(model_dir: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, 32000, (PROMPT_TOKENS,), generator=generator).tolist()
    tokens, exl = exllamav2_logits(model_dir, prompt)
    assert len(tokens) == DECODE_STEPS

    hf = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float16).cuda()
    with torch.inference_mode():
        ids = torch.tensor([prompt + tokens[:-1]], device="cuda")
        ref = hf(ids).logits[0, PROMPT_TOKENS - 1 :].float().cpu()
    assert ref.shape == exl.shape

    diff = (exl - ref).abs()
    top1 = (exl.argmax(-1) == ref.argmax(-1)).float()
    scale = ref.abs().max().item()
    print(
        f"\nlogits vs transformers: prefill max abs diff {diff[0].max():.4g}, "
        f"decode max abs diff {diff[1:].max():.4g} (logit scale {scale:.3g}); "
        f"top-1 agreement prefill {top1[0]:.0%}, decode {top1[1:].mean():.1%}"
    )
    assert diff.max().item() <= 0.02 * scale
    assert top1.mean().item() >= 0.9
