"""Every declared config key does what its docstring says, or is gone.

A key no code reads is accepted, printed in configs/defaults.yaml and documented, yet changes
nothing. This lists every field of every config dataclass of the package (those of each
`config.py` under verl/, and the dataclasses they nest, wherever those are declared) and fails,
naming the fields, when one is read nowhere outside its declaration. A field counts as read when
a module of verl/ mentions `.name` or the string "name" outside the `config.py` that declares it
(which only declares and validates), or outside the class body for a dataclass declared beside
the code using it (`PolicyLossConfig`). A crude but honest proxy: a mention is not proof of use,
an absence is proof of none. The keys kept for EasyR1's configs that can hold one value only
(`ONE_VALUE_KEYS`) are exempt, and each must refuse another value in one line.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import re
import typing
from pathlib import Path

import pytest

from verl.trainer.config import load_config
from verl.utils.config_checks import ConfigError

VERL = Path(__file__).resolve().parents[1] / "verl"
ONE_VALUE_KEYS = {
    "WorkerConfig.hybrid_engine": ("worker.hybrid_engine=false",
                                   "worker.hybrid_engine=False is not valid; expected true: actor and rollout are always colocated"),
    "ActorConfig.strategy": ("worker.actor.strategy=megatron",
                             "worker.actor.strategy='megatron' is not valid; valid: fsdp"),
}  # fmt: skip
"""Fields read by validation only, which allows one value (what the code always does): the
override trying another value, and the start of its one-line refusal."""


def config_dataclasses(root: Path = VERL) -> dict[type, Path]:
    """Every dataclass declared in a `config.py` under `root`, and every dataclass nested in one
    through a field's type (`list[X]`, `X | None` included), with the file declaring it."""
    found: dict[type, Path] = {}
    pending: list[type] = []
    for path in sorted(root.rglob("config.py")):
        name = ".".join(path.relative_to(root.parent).with_suffix("").parts)
        module = importlib.import_module(name)
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if dataclasses.is_dataclass(cls) and cls.__module__ == name:
                pending.append(cls)
    while pending:
        cls = pending.pop()
        if cls in found:
            continue
        found[cls] = Path(inspect.getsourcefile(cls)).resolve()
        for hint in typing.get_type_hints(cls).values():
            stack = [hint]
            while stack:  # the dataclasses inside unions and generics too
                arg = stack.pop()
                if dataclasses.is_dataclass(arg) and isinstance(arg, type):
                    pending.append(arg)
                stack.extend(typing.get_args(arg))
    return found


def _readers(cls: type, declared: Path, sources: dict[Path, str]) -> list[str]:
    """The texts a field of `cls` may be read in: every module but the `config.py` declaring
    it, or, declared elsewhere, every module with the class's own body left out."""
    if declared.name == "config.py":
        return [text for path, text in sources.items() if path != declared]
    lines, start = inspect.getsourcelines(cls)
    text = sources[declared].splitlines(keepends=True)
    rest = "".join(text[: start - 1] + text[start - 1 + len(lines) :])
    return [rest] + [text for path, text in sources.items() if path != declared]


def unread_fields(classes: dict[type, Path], root: Path = VERL) -> list[str]:
    """`Class.field (declared in file)` for every field that no module under `root` mentions as
    `.field` or as the string "field" outside its declaration (`_readers`)."""
    sources = {path.resolve(): path.read_text(encoding="utf-8") for path in root.rglob("*.py")}
    unread = []
    for cls, declared in sorted(classes.items(), key=lambda item: item[0].__qualname__):
        readers = _readers(cls, declared, sources)
        for field in dataclasses.fields(cls):
            pattern = re.compile(rf"\.{field.name}\b|([\"']){field.name}\1")
            if not any(pattern.search(text) for text in readers):
                unread.append(f"{cls.__name__}.{field.name} ({declared.relative_to(root.parent)})")
    return unread


def test_the_checker_finds_nested_dataclasses_and_flags_a_field_nobody_reads(tmp_path):
    """A field only validated in its config.py is unread; one of a dataclass declared beside
    its code counts as read there, outside the class body; nested dataclasses are followed."""
    package = tmp_path / "fieldcheck_demo"
    (package / "section").mkdir(parents=True)
    for folder in (package, package / "section"):
        (folder / "__init__.py").write_text("")
    (package / "section" / "loss.py").write_text(
        "from dataclasses import dataclass\n"
        "@dataclass\nclass Loss:\n    eps: float = 0.1\n    spare: float = 0.0\n"
        "def loss(config: Loss):\n    return config.eps\n"
    )
    (package / "section" / "config.py").write_text(
        "from dataclasses import dataclass, field\n"
        "from fieldcheck_demo.section.loss import Loss\n"
        "@dataclass\nclass Inner:\n    used_by_string: int = 0\n    orphan: int = 0\n"
        "    def validate(self):\n        assert self.orphan >= 0\n"
        "@dataclass\nclass Outer:\n    inner: Inner | None = field(default_factory=Inner)\n"
        "    losses: list[Loss] = field(default_factory=list)\n"
        "    used_by_attribute: bool = True\n"
    )
    (package / "reader.py").write_text(
        "def run(cfg):\n    return cfg.inner, cfg.used_by_attribute, getattr(cfg, 'used_by_string'), cfg.losses\n"
    )
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(tmp_path))
        classes = config_dataclasses(package)
        assert sorted(cls.__name__ for cls in classes) == ["Inner", "Loss", "Outer"]
        assert unread_fields(classes, package) == [
            "Inner.orphan (fieldcheck_demo/section/config.py)",
            "Loss.spare (fieldcheck_demo/section/loss.py)",
        ]


def test_every_config_field_is_read_outside_its_declaration():
    classes = config_dataclasses()
    names = {cls.__name__ for cls in classes}
    assert {"PPOConfig", "WorkerConfig", "FSDPConfig", "OffloadConfig", "RolloutConfig"} <= names
    unread = [line for line in unread_fields(classes) if line.split()[0] not in ONE_VALUE_KEYS]
    assert not unread, f"config fields that no code reads: {', '.join(unread)}"


@pytest.mark.parametrize(
    ("override", "message"),
    [*ONE_VALUE_KEYS.values(),
     ("trainer.val_generations_to_log=-1", "trainer.val_generations_to_log=-1 is not valid")],
)  # fmt: skip
def test_keys_refuse_values_they_cannot_honour_in_one_line(override, message):
    with pytest.raises(ConfigError) as info:
        load_config([override])
    assert "\n" not in str(info.value) and str(info.value).startswith(message)


def test_easyr1_configs_may_keep_hybrid_engine_true():
    assert load_config(["worker.hybrid_engine=true"]).worker.hybrid_engine is True
