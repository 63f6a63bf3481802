"""LoRA serving configuration: a frozen dataclass built once (``--enable-lora`` and friends)."""

from __future__ import annotations

import re
from dataclasses import dataclass

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/@+-]{0,127}$")


def check_lora_name(name: str) -> str:
    """Raise ``ValueError`` unless ``name`` can name an adapter (what requests put in
    ``lora_name`` and /v1/models lists): 1-128 characters, letters, digits and ``._:/@+-``,
    starting with a letter or digit."""
    if not _NAME.match(name):
        raise ValueError(
            f"lora_name {name!r} is invalid: use 1-128 letters, digits or ._:/@+- "
            "starting with a letter or digit"
        )
    return name


@dataclass(frozen=True)
class LoRAConfig:
    """How many adapters the engine serves and how large they may be.

    max_loras      adapters on the device at once (one step never mixes more); vLLM's default 1
    max_lora_rank  the largest rank accepted; every device slot is padded to it (vLLM: 16)
    max_cpu_loras  adapters whose weights stay in host memory; the least recently used idle,
                   unpinned ones beyond it are dropped and read again from their directory when
                   a request names them. None: no limit (vLLM's default is max_loras)
    modules        (name, path) of the adapters loaded at start (``--lora-modules name=path``)
    """

    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    modules: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        if self.max_loras < 1:
            raise ValueError(f"max_loras must be at least 1, got {self.max_loras}")
        if self.max_lora_rank < 1:
            raise ValueError(f"max_lora_rank must be at least 1, got {self.max_lora_rank}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(
                f"max_cpu_loras ({self.max_cpu_loras}) must be at least max_loras "
                f"({self.max_loras})"
            )
        names = [name for name, _ in self.modules]
        for name in names:
            check_lora_name(name)
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"lora modules name the same adapter twice: {', '.join(dupes)}")


def parse_lora_modules(values: list[str]) -> tuple[tuple[str, str], ...]:
    """``["name=path", ...]`` (``--lora-modules``) -> ((name, path), ...). Raises ValueError
    naming the entry that is not ``name=path``. (vLLM also takes JSON objects; not here.)"""
    out = []
    for value in values:
        name, sep, path = value.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora-modules expects name=path, got {value!r}")
        out.append((check_lora_name(name.strip()), path.strip()))
    return tuple(out)
