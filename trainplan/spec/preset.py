"""The presets: config.json files shipped for the models people plan (trainplan/spec/presets/), each named by the
Hub id it describes, its short name and the id's repository part as aliases. Read once a process."""

from __future__ import annotations

import functools
import json
from pathlib import Path

from trainplan.errors import ConfigError, nearest

PRESET_DIR = Path(__file__).parent / "presets"


@functools.cache
def _presets() -> dict[str, tuple[str, str, str]]:
    """lower-case name -> (canonical name, file stem, the name as written). A preset is named by
    the Hub id it describes (`meta-llama/Llama-3.1-8B`); its short name (`Llama-3.1-8B`) and the
    id's repository part (`gpt2`) are aliases."""
    out: dict[str, tuple[str, str, str]] = {}
    for path in sorted(PRESET_DIR.glob("*.json")):
        hub_id = json.loads(path.read_text()).get("_hub_id")
        canonical = hub_id or path.stem
        for alias in (canonical, path.stem, hub_id.split("/")[1] if hub_id else None):
            if alias:
                out.setdefault(alias.lower(), (canonical, path.stem, alias))
    return out


def preset_names() -> list[str]:
    """Every preset's canonical name (its Hub id where it describes one)."""
    return sorted({canonical for canonical, _, _ in _presets().values()})


def preset_aliases() -> list[str]:
    """Every name a preset answers to (Hub ids and short names), for suggestions."""
    return sorted(alias for _, _, alias in _presets().values())


def find_preset(name: str) -> str | None:
    """The canonical name of the preset `name` names (canonical or alias), or None."""
    hit = _presets().get(name.lower())
    return hit[0] if hit else None


def preset_config(name: str) -> dict:
    """The config.json dict shipped for a preset (keys starting with '_' are provenance)."""
    hit = _presets().get(name.lower())
    if hit is None:
        raise ConfigError("model.source", f"unknown preset {name!r}", nearest(name, preset_aliases()))
    cfg = json.loads((PRESET_DIR / f"{hit[1]}.json").read_text())
    return {k: v for k, v in cfg.items() if not k.startswith("_")}
