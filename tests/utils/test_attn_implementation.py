"""The attention resolver imports flash-attn for real (issue 27, item 6): `find_spec` finds a
build for another torch just as well as a working one, and that build crashes every rank when the
model loads. Each branch is made to fire with stand-in modules: a flash-attn that imports, one
whose CUDA extension raises at import (what a wrong ABI does), and the absence of CUDA."""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
import types

import pytest

from verl.utils import attention
from verl.utils.attention import flash_attn_import_error, resolve_attn_implementation

ABI_ERROR = "flash_attn_2_cuda.so: undefined symbol: _ZN3c104cuda9SetDeviceEi"


class RaisingExtension(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """A `flash_attn_2_cuda` that is found (find_spec succeeds) but raises when imported."""

    def find_spec(self, name, path=None, target=None):
        if name == "flash_attn_2_cuda":
            return importlib.util.spec_from_loader(name, self)
        return None

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        raise ImportError(ABI_ERROR)


@pytest.fixture(autouse=True)
def fresh_resolver(monkeypatch):
    """No cached import result or earlier warning; no real flash-attn (there is none here)."""
    for name in attention.FLASH_ATTN_MODULES:
        monkeypatch.delitem(sys.modules, name, raising=False)
    flash_attn_import_error.cache_clear()
    monkeypatch.setattr(attention, "_WARNED", set())
    yield
    flash_attn_import_error.cache_clear()


def install_flash_attn(monkeypatch, extension_works: bool) -> None:
    monkeypatch.setitem(sys.modules, "flash_attn", types.ModuleType("flash_attn"))
    if extension_works:
        monkeypatch.setitem(sys.modules, "flash_attn_2_cuda", types.ModuleType("flash_attn_2_cuda"))
    else:
        monkeypatch.setattr(sys, "meta_path", [RaisingExtension(), *sys.meta_path])


def test_plain_kernels_and_cpu_never_import_flash_attn(monkeypatch, capsys):
    monkeypatch.setattr(attention, "flash_attn_import_error", lambda: pytest.fail("imported"))
    assert resolve_attn_implementation("auto", "cpu") == "sdpa"
    assert resolve_attn_implementation("eager", "cpu") == "eager"
    assert resolve_attn_implementation("sdpa", "cuda") == "sdpa"
    assert resolve_attn_implementation("eager", "cuda") == "eager"
    assert capsys.readouterr().err == ""  # sdpa is what CPU always uses: nothing to warn about


def test_auto_picks_flash_attention_when_it_imports(monkeypatch, capsys):
    install_flash_attn(monkeypatch, extension_works=True)
    assert flash_attn_import_error() is None
    assert resolve_attn_implementation("auto", "cuda") == "flash_attention_2"
    assert resolve_attn_implementation("flash_attention_2", "cuda") == "flash_attention_2"
    assert capsys.readouterr().err == ""


def test_auto_falls_back_to_sdpa_with_one_warning_line_when_the_extension_fails(
    monkeypatch, capsys
):
    install_flash_attn(monkeypatch, extension_works=False)
    assert importlib.util.find_spec("flash_attn_2_cuda") is not None  # the old check said yes
    assert resolve_attn_implementation("auto", "cuda") == "sdpa"
    assert resolve_attn_implementation("auto", "cuda") == "sdpa"  # (the reference model loads too)
    err = capsys.readouterr().err.splitlines()
    assert err == [
        f"warning: flash-attn is not usable (import flash_attn_2_cuda failed: ImportError: "
        f"{ABI_ERROR}); attention uses sdpa"
    ]


def test_auto_falls_back_when_flash_attn_is_absent(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "flash_attn", None)  # `import flash_attn` raises ImportError
    assert resolve_attn_implementation("auto", "cuda") == "sdpa"
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("warning: flash-attn is not usable (import flash_attn failed:")


def test_explicit_flash_attention_that_cannot_import_fails_in_one_line(monkeypatch):
    install_flash_attn(monkeypatch, extension_works=False)
    with pytest.raises(ValueError) as error:
        resolve_attn_implementation("flash_attention_2", "cuda")
    message = str(error.value)
    assert "\n" not in message
    assert message.startswith(
        "worker.actor.model.attn_implementation='flash_attention_2' cannot be used: "
        "import flash_attn_2_cuda failed: ImportError: "
    )
    assert "valid here: auto, sdpa, eager" in message and "VERL_FLASH_ATTN=1" in message


def test_explicit_flash_attention_without_cuda_fails_in_one_line():
    with pytest.raises(ValueError, match=r"cannot be used: this process has no CUDA device; valid here: auto, sdpa, eager$"):  # fmt: skip
        resolve_attn_implementation("flash_attention_2", "cpu")


def test_the_command_line_refuses_an_unusable_flash_attention_before_any_work(capsys):
    from verl.trainer.main import main

    assert (
        main(["worker.actor.model.attn_implementation=flash_attention_2", "trainer.device=cpu"])
        == 2
    )
    assert capsys.readouterr().err == (
        "error: worker.actor.model.attn_implementation='flash_attention_2' cannot be used: this "
        "process has no CUDA device; valid here: auto, sdpa, eager\n"
    )
