"""The node's LoRA adapters: which names it serves and where their files are.

``AdapterCatalog`` is built once at start from the node config (``adapters``: name -> adapter
folder; ``adapter_dir``: a folder whose subfolders are adapters named after them, an explicit
entry winning over a subfolder of the same name). An adapter folder is PEFT's format
(``adapter_config.json`` + ``adapter_model.safetensors``), what vLLM's ``LoRARequest`` loads.

The catalog is fixed for the process (the node's registration lists ``names``, and routers
send an adapter only to nodes that list it), so:

- a name not in it -> NOT_FOUND: this node can never serve it;
- a name in it whose files cannot be loaded now (deleted, unreadable, corrupt) -> the engine
  fails the load -> FAILED_PRECONDITION (``node.errors``): the configuration says it is
  served, the files disagree;
- an adapter whose rank exceeds ``max_lora_rank``, or whose folder has no readable
  ``adapter_config.json`` at start, is left out of the catalog with a warning (the engine
  could never load it), so it too answers NOT_FOUND.

Ids: each name gets a stable positive integer (1-based, in name order), vLLM's
``lora_int_id``. Building the catalog reads small files (blocking): the node builds it before
its event loop serves requests.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Mapping
from pathlib import Path

from pydantic import BaseModel, Field

from gpumesh.config import SECTION, KeyValues
from gpumesh.node.engines.base import AdapterRef

log = logging.getLogger(__name__)

MAX_ADAPTERS = 1024
# What a registration may carry (control.proto ServedModel.adapters): printable, no spaces.
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/@+-]{0,127}$")



class LoraSettings(BaseModel):
    """The node's ``[lora]`` section: adapters served by name on GenerateRequest.adapter and
    loaded on demand. Either ``adapters`` or ``adapter_dir`` turns LoRA on in the engine."""

    model_config = SECTION

    adapters: KeyValues = Field(default_factory=dict,
                                     description="Adapter name -> adapter folder (PEFT format).")
    adapter_dir: str = Field("", description="A folder whose subfolders are adapters named "
                                             "after them.")
    max_loras: int = Field(2, ge=1, description="Adapters in one batch (vLLM); held at once "
                                                "(sim).")
    max_lora_rank: int = Field(16, ge=1, description="Largest adapter rank served.")
    max_cpu_loras: int = Field(0, ge=0, description="Adapters vLLM keeps loaded; 0 = max_loras.")

class AdapterError(Exception):
    """A configured adapter set that cannot be built (bad name, too many)."""


def _rank(folder: Path) -> int | None:
    """The adapter's rank from its adapter_config.json, None when unreadable."""
    try:
        cfg = json.loads((folder / "adapter_config.json").read_text(encoding="utf-8"))
        return int(cfg.get("r", 0)) or None
    except (OSError, ValueError, TypeError, AttributeError):
        return None


class AdapterCatalog:
    """Adapter name -> ``AdapterRef`` (module doc). Empty: LoRA off."""

    def __init__(self, refs: Mapping[str, AdapterRef]) -> None:
        self._refs = dict(refs)
        self.names: tuple[str, ...] = tuple(sorted(self._refs))

    @classmethod
    def from_config(cls, adapters: Mapping[str, str], adapter_dir: str,
                    max_lora_rank: int) -> AdapterCatalog:
        """Scans ``adapter_dir`` (subfolders holding adapter_config.json) and adds the
        explicit ``adapters``; drops adapters the engine could never load (module doc)."""
        found: dict[str, Path] = {}
        if adapter_dir:
            root = Path(adapter_dir)
            if not root.is_dir():
                raise AdapterError(f"adapter_dir {adapter_dir!r} is not a folder")
            for sub in sorted(root.iterdir()):
                if sub.is_dir() and (sub / "adapter_config.json").is_file():
                    found[sub.name] = sub
        for name, path in adapters.items():
            found[name] = Path(path)
        refs: dict[str, Path] = {}
        for name, folder in sorted(found.items()):
            if not _NAME.match(name):
                raise AdapterError(f"adapter name {name!r}: 1-128 characters of "
                                   "[A-Za-z0-9._:/@+-], starting with a letter or digit")
            rank = _rank(folder)
            if rank is None:
                log.warning("adapter %s: no readable adapter_config.json in %s; not served",
                            name, folder)
                continue
            if rank > max_lora_rank:
                log.warning("adapter %s: rank %d > max_lora_rank %d; not served", name, rank,
                            max_lora_rank)
                continue
            refs[name] = folder
        if len(refs) > MAX_ADAPTERS:
            raise AdapterError(f"{len(refs)} adapters configured; at most {MAX_ADAPTERS}")
        return cls({name: AdapterRef(name, str(folder.resolve()), i)
                    for i, (name, folder) in enumerate(sorted(refs.items()), start=1)})

    def __len__(self) -> int:
        return len(self._refs)

    def __bool__(self) -> bool:
        return bool(self._refs)

    def get(self, name: str) -> AdapterRef | None:
        """The adapter called ``name``, None when this node does not serve it."""
        return self._refs.get(name)
