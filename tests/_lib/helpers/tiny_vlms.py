"""Tiny random vision-language models and image+text batches, built in-process (no downloads).

- ``tiny_vlm(model_type)``: a ``*ForConditionalGeneration`` of Qwen2.5-VL, Qwen2-VL or Gemma 3 with
  a two-layer language tower (GQA, each family's distinctive options on) and a small vision tower.
- ``image_processor(model_type)``: the family's PIL image processor from its class defaults, only
  the image size made small (no torchvision needed).
- ``vlm_batch(...)``: right-padded rows of random text ids around one image placeholder block each,
  the images' ``pixel_values`` from that processor, labels with the prompt, padding and (optionally)
  the image tokens ignored. Qwen rows carry ``mm_token_type_ids`` (the 3-D RoPE positions need
  them), Gemma rows ``token_type_ids`` (the bidirectional image mask).

The special ids sit at the top of a 512-row vocabulary; text ids are drawn below them.
"""

from __future__ import annotations

import numpy as np
import torch

VLM_TYPES = ("qwen2_5_vl", "qwen2_vl", "gemma3")
VOCAB = 512
IMAGE_ID, START_ID, END_ID, VIDEO_ID = 500, 501, 502, 503  # Qwen: image pad / vision start / end / video pad
BOI_ID, EOI_ID = 501, 502  # Gemma 3: begin / end of image (IMAGE_ID is its soft image token)
PAD_ID = 0
TEXT_IDS = (3, 480)

_TEXT = dict(vocab_size=VOCAB, hidden_size=96, intermediate_size=200, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6, attention_dropout=0.0,
             bos_token_id=1, eos_token_id=2)
# 3-D RoPE: head_dim 24 → 12 frequencies split into temporal / height / width sections.
_MROPE = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 4, 4]}


def tiny_vlm_config(model_type: str, token_ids: dict | None = None, vision: dict | None = None, **text_overrides):
    """A tiny config of ``model_type`` with eager attention (exact parity); ``token_ids`` overrides the
    special ids (``processor_token_ids`` of an in-process processor), ``vision`` the vision config's fields."""
    from transformers import Gemma3Config, Qwen2_5_VLConfig, Qwen2VLConfig

    text = {**_TEXT, **text_overrides}
    if model_type == "qwen2_5_vl":
        config = Qwen2_5_VLConfig(
            text_config={**dict(rope_parameters=dict(_MROPE)), **text},
            vision_config=dict(depth=2, hidden_size=64, intermediate_size=96, num_heads=2, out_hidden_size=96,
                               patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=56,
                               fullatt_block_indexes=[1]),
            image_token_id=IMAGE_ID, video_token_id=VIDEO_ID, vision_start_token_id=START_ID,
            vision_end_token_id=END_ID)
    elif model_type == "qwen2_vl":
        config = Qwen2VLConfig(
            text_config={**dict(rope_parameters=dict(_MROPE)), **text},
            vision_config=dict(depth=2, embed_dim=64, hidden_size=96, mlp_ratio=2, num_heads=2, patch_size=14,
                               spatial_merge_size=2, temporal_patch_size=2),
            image_token_id=IMAGE_ID, video_token_id=VIDEO_ID, vision_start_token_id=START_ID,
            vision_end_token_id=END_ID)
    elif model_type == "gemma3":
        # Stock Gemma3ForConditionalGeneration ignores the text config's final soft-cap: set it anyway,
        # so a head that applied it would fail parity. One sliding and one global layer, a short window.
        config = Gemma3Config(
            text_config={**dict(head_dim=24, query_pre_attn_scalar=24, sliding_window=8,
                                layer_types=["sliding_attention", "full_attention"],
                                final_logit_softcapping=30.0, pad_token_id=PAD_ID), **text},
            vision_config=dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=64,
                               num_hidden_layers=1, num_attention_heads=2, image_size=28, patch_size=7),
            mm_tokens_per_image=4, image_token_index=IMAGE_ID, boi_token_index=BOI_ID, eoi_token_index=EOI_ID)
    else:
        raise ValueError(f"model_type must be one of {VLM_TYPES}, got {model_type!r}")
    for name, value in (token_ids or {}).items():
        setattr(config, name, value)
    for name, value in (vision or {}).items():
        setattr(config.vision_config, name, value)
    config._attn_implementation = "eager"
    for sub in (config.get_text_config(), getattr(config, "vision_config", None)):
        if sub is not None:
            sub._attn_implementation = "eager"
    return config


def tiny_vlm(model_type: str = "qwen2_5_vl", dtype=torch.float32, seed: int = 0, token_ids: dict | None = None,
             vision: dict | None = None, **text_overrides):
    """A random ``*ForConditionalGeneration`` of ``model_type`` in ``dtype``; every RMSNorm weight random."""
    from transformers import AutoModelForImageTextToText

    torch.manual_seed(seed)
    config = tiny_vlm_config(model_type, token_ids, vision, **text_overrides)
    model = AutoModelForImageTextToText.from_config(config, dtype=dtype, attn_implementation="eager")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and p.dim() == 1:
                p.normal_(0.0, 0.2).add_(0.0 if model_type == "gemma3" else 1.0)
            if name.endswith("mm_input_projection_weight"):  # zeros at init: the image would not reach the text
                p.normal_(0.0, 0.2)
    return model.train()


def image_processor(model_type: str):
    """The family's PIL image processor, built from its class defaults (small images only)."""
    if model_type in ("qwen2_5_vl", "qwen2_vl"):
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        return Qwen2VLImageProcessorPil(min_pixels=4 * 28 * 28, max_pixels=16 * 28 * 28)
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    return Gemma3ImageProcessorPil(size={"height": 28, "width": 28})


def random_images(n: int, seed: int = 0, sizes=((56, 84), (84, 56), (56, 56))):
    """``n`` PIL RGB images of random pixels, cycling through ``sizes`` (height, width)."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 256, (*sizes[i % len(sizes)], 3), dtype=np.uint8)) for i in range(n)]


def _image_block(model_type: str, config, grid) -> list[int]:
    if model_type == "gemma3":
        return [BOI_ID] + [IMAGE_ID] * config.mm_tokens_per_image + [EOI_ID]
    merge = config.vision_config.spatial_merge_size
    return [START_ID] + [IMAGE_ID] * (int(torch.as_tensor(grid).prod()) // merge ** 2) + [END_ID]


def vlm_batch(model_type: str, config, images=None, *, prompt_lens=(5, 3), answer_lens=(6, 9), seed: int = 0,
              mask_images: bool = True, padding_side: str = "right", device="cpu") -> dict:
    """One row per image: ``prompt`` text, the image block, ``answer`` text; padded on ``padding_side``.

    Labels: the answers (and the image block unless ``mask_images``); prompt and padding ignored.
    """
    images = images if images is not None else random_images(len(prompt_lens), seed)
    pixels = image_processor(model_type)(images=images, return_tensors="pt")
    g = torch.Generator().manual_seed(seed)
    rows, label_rows = [], []
    for i, (p, a) in enumerate(zip(prompt_lens, answer_lens)):
        grid = pixels["image_grid_thw"][i] if "image_grid_thw" in pixels else None
        prompt = torch.randint(*TEXT_IDS, (p,), generator=g).tolist()
        answer = torch.randint(*TEXT_IDS, (a,), generator=g).tolist()
        block = _image_block(model_type, config, grid)
        rows.append(prompt + block + answer)
        label_rows.append([-100] * p + ([-100] * len(block) if mask_images else block) + answer)
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), PAD_ID)
    labels = torch.full((len(rows), width), -100)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, (r, lab) in enumerate(zip(rows, label_rows)):
        at = slice(0, len(r)) if padding_side == "right" else slice(width - len(r), width)
        ids[i, at], labels[i, at], mask[i, at] = torch.tensor(r), torch.tensor(lab), 1
    batch = {"input_ids": ids, "attention_mask": mask, "labels": labels, "pixel_values": pixels["pixel_values"]}
    image_tokens = (ids == IMAGE_ID).long()
    if model_type == "gemma3":
        batch["token_type_ids"] = image_tokens
    else:
        batch["image_grid_thw"] = pixels["image_grid_thw"]
        batch["mm_token_type_ids"] = image_tokens
    return {k: v.to(device) for k, v in batch.items()}


# Chat templates that render image parts as the processor's placeholder, with {% generation %} marks
# (assistant_only_loss). Content is a string or a list of {"type": "text"/"image"} parts.
_PARTS = ("{% if message['content'] is string %}{% set parts = [{'type': 'text', 'text': message['content']}] %}"
          "{% else %}{% set parts = message['content'] %}{% endif %}")


def _template(start: str, end: str, assistant: str, image: str, bos: str = "") -> str:
    return (bos + "{% for message in messages %}"
            f"{{% set role = '{assistant}' if message['role'] == 'assistant' else message['role'] %}}"
            f"{{{{ '{start}' + role + '\n' }}}}" + _PARTS +
            "{% if message['role'] == 'assistant' %}{% generation %}"
            f"{{% for p in parts %}}{{{{ p['text'] }}}}{{% endfor %}}{{{{ '{end}' }}}}{{% endgeneration %}}"
            "{{ '\n' }}"
            f"{{% else %}}{{% for p in parts %}}{{% if p['type'] == 'image' %}}{{{{ '{image}' }}}}"
            f"{{% else %}}{{{{ p['text'] }}}}{{% endif %}}{{% endfor %}}{{{{ '{end}\n' }}}}{{% endif %}}{{% endfor %}}"
            f"{{% if add_generation_prompt %}}{{{{ '{start}{assistant}\n' }}}}{{% endif %}}")


def vlm_processor(model_type: str):
    """The family's processor, built in-process: a tiny tokenizer with the image tokens, the PIL image
    processor, a chat template. Qwen2-VL/2.5-VL's processor also needs a video processor, which needs
    torchvision: the test calling this is skipped without it."""
    from .tiny_tokenizers import bpe_tokenizer, sp_tokenizer

    if model_type == "gemma3":
        from transformers import Gemma3Processor

        tok = sp_tokenizer(boi_token="<start_of_image>", eoi_token="<end_of_image>", image_token="<image_soft_token>")
        tok.pad_token = "<unk>"
        template = _template("<start_of_turn>", "<end_of_turn>", "model", "<start_of_image>", "{{ bos_token }}")
        return Gemma3Processor(image_processor=image_processor(model_type), tokenizer=tok, chat_template=template,
                               image_seq_length=tiny_vlm_config(model_type).mm_tokens_per_image)
    from transformers import Qwen2_5_VLProcessor, Qwen2VLProcessor
    from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor

    tok = bpe_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
                                                          "<|video_pad|>"]}, replace_extra_special_tokens=False)
    video = Qwen2VLVideoProcessor()
    cls = Qwen2_5_VLProcessor if model_type == "qwen2_5_vl" else Qwen2VLProcessor
    template = _template("<|im_start|>", "<|im_end|>", "assistant", "<|vision_start|><|image_pad|><|vision_end|>")
    return cls(image_processor=image_processor(model_type), tokenizer=tok, video_processor=video,
               chat_template=template)


def processor_token_ids(model_type: str, processor) -> dict:
    """The config's special ids as ``processor``'s tokenizer numbers them (for ``tiny_vlm(token_ids=...)``)."""
    ids = processor.tokenizer.convert_tokens_to_ids
    if model_type == "gemma3":
        tok = processor.tokenizer
        return {"image_token_id": tok.image_token_id, "boi_token_index": tok.boi_token_id,
                "eoi_token_index": tok.eoi_token_id, "pad_token_id": tok.pad_token_id}
    return {"image_token_id": ids("<|image_pad|>"), "video_token_id": ids("<|video_pad|>"),
            "vision_start_token_id": ids("<|vision_start|>"), "vision_end_token_id": ids("<|vision_end|>")}
