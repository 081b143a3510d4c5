"""llama.cpp's multimodal library (``libmtmd``, through llama-cpp-python's ``mtmd_cpp``) on one image:
the image embeddings an mmproj GGUF gives, as llama.cpp would put them into the text model."""

from __future__ import annotations

import ctypes

import numpy as np


def mtmd_image_embeddings(text_gguf, mmproj_gguf, rgb: np.ndarray) -> np.ndarray:
    """[n_image_tokens, n_embd] float32 embeddings of ``rgb`` (uint8, H x W x 3) from ``mmproj_gguf``,
    loaded beside the language model ``text_gguf`` (mtmd checks the widths match). CPU, one thread,
    no flash attention, no warm-up pass."""
    import llama_cpp
    import llama_cpp.mtmd_cpp as mtmd

    llm = llama_cpp.Llama(model_path=str(text_gguf), n_ctx=64, verbose=False, n_threads=1)
    params = mtmd.mtmd_context_params_default()
    params.use_gpu, params.n_threads, params.print_timings, params.warmup = False, 1, False, False
    params.flash_attn_type = 0  # disabled: plain soft-max attention
    ctx = mtmd.mtmd_init_from_file(str(mmproj_gguf).encode(), llm._model.model, params)
    if not ctx:
        llm.close()
        raise RuntimeError(f"mtmd_init_from_file refused {mmproj_gguf}")
    chunks = mtmd.mtmd_input_chunks_init()
    h, w, _ = rgb.shape
    data = np.ascontiguousarray(rgb, dtype=np.uint8).tobytes()
    bitmap = mtmd.mtmd_bitmap_init(w, h, (ctypes.c_uint8 * len(data)).from_buffer_copy(data))
    try:
        marker = mtmd.mtmd_default_marker()
        text = mtmd.mtmd_input_text(text=marker, text_len=len(marker), add_special=False, parse_special=True)
        bitmaps = (mtmd.mtmd_bitmap_p_ctypes * 1)(bitmap)
        rc = mtmd.mtmd_tokenize(ctx, chunks, ctypes.byref(text), bitmaps, 1)
        if rc != 0:
            raise RuntimeError(f"mtmd_tokenize failed with {rc}")
        n_embd = llm.n_embd()
        for i in range(mtmd.mtmd_input_chunks_size(chunks)):
            chunk = mtmd.mtmd_input_chunks_get(chunks, i)
            if mtmd.mtmd_input_chunk_get_type(chunk) != mtmd.MTMD_INPUT_CHUNK_TYPE_IMAGE:
                continue
            if mtmd.mtmd_encode_chunk(ctx, chunk) != 0:
                raise RuntimeError("mtmd_encode_chunk failed")
            n = mtmd.mtmd_input_chunk_get_n_tokens(chunk)
            out = mtmd.mtmd_get_output_embd(ctx)
            return np.ctypeslib.as_array(out, shape=(n * n_embd,)).reshape(n, n_embd).copy()
        raise RuntimeError("mtmd_tokenize produced no image chunk")
    finally:
        mtmd.mtmd_bitmap_free(bitmap)
        mtmd.mtmd_input_chunks_free(chunks)
        mtmd.mtmd_free(ctx)
        llm.close()
