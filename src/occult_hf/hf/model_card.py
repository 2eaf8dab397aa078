"""What a checkpoint saved with collaboration pruning says about itself, where any reader sees it.

A pruned model (`OccultConfig.prune`: each token's experts limited to `N_d` devices) is a different
function from the same weights run with the model's own routing. occult_hf loads (`from_pretrained` with
occult_hf imported, `occult eval`) read the `occult_config` stored on the saved config and apply the
pruning again; plain transformers, `lm_eval --model hf` or another machine without occult_hf cannot be
warned from outside and run the unpruned routing, silently. So `save_pretrained` of a pruned model writes
it down twice:

- `config.json` gets `occult_pruning`: the mode, `N_d` and/or `N_n` (node-limited), the device count (and
  devices per node), the placement file and a note;
- `README.md` (the Hub's model card) gets a section at its top, between the `occult_hf:pruning` markers,
  saying the same in words; a card that is already there (yours, or the Trainer's) is kept below it.
"""

from __future__ import annotations

import re

from ..config import PRUNING_CONFIG_KEY, OccultConfig
from ..placement import PLACEMENT_FILENAME

CARD_FILENAME = "README.md"
_BEGIN, _END = "<!-- occult_hf:pruning -->", "<!-- /occult_hf:pruning -->"
#: YAML front matter, which the Hub reads only at the top of the card: as huggingface_hub's `REGEX_YAML_BLOCK` finds
#: it (blank space before it, blanks after the closing `---`, which may end the file); a byte-order mark before it
#: (which that pattern does not allow) is kept in front of it, where the section would hide the front matter too
_FRONT_MATTER = re.compile(r"\A\ufeff?\s*---(?:\r\n|\r|\n)[\S\s]*?(?:\r\n|\r|\n)---[ \t]*(?:\r\n|\n|\Z)")


def pruning_description(config: OccultConfig) -> dict | None:
    """The `occult_pruning` entry of a pruned model's saved config (None for an exact one)."""
    if config.prune is None:
        return None
    return {
        "prune": config.prune,
        "max_devices_per_token": config.max_devices_per_token,
        "max_nodes_per_token": config.max_nodes_per_token,
        "num_devices": config.num_devices,
        "devices_per_node": config.devices_per_node,
        "placement": PLACEMENT_FILENAME,
        "note": (
            "saved by occult_hf with collaboration pruning on (fine-tuned with it if it was trained so): occult_hf "
            "loads apply it; plain transformers runs the unpruned routing, which is not this model"
        ),
    }


def card_with_pruning(config: OccultConfig, existing: str | None) -> str:
    """The model card of a pruned checkpoint: its pruning section first (after any YAML front matter), then
    `existing` without an older pruning section."""
    body = strip_pruning_section(existing or "")
    front = _FRONT_MATTER.match(body)
    head, rest = (front.group(0), body[front.end() :]) if front else ("", body)
    if head and not head.endswith("\n"):  # the closing `---` ended the card: the section starts on a line of its own
        head += "\r\n" if "\r\n" in head else "\n"
    section = (
        f"{_BEGIN}\n"
        f"**Saved with collaboration pruning (occult_hf).** Each token's routed experts are limited to "
        f"{_limits(config)} (`prune={config.prune!r}`, placement `{PLACEMENT_FILENAME}`). "
        f"Plain transformers, `lm_eval --model hf` or any load without occult_hf runs the **unpruned** routing, "
        f"which is not this model's (nor, after pruning-aware fine-tuning, the one trained): load it with occult_hf "
        f"imported (`import occult_hf`, then `AutoModelForCausalLM.from_pretrained(...)`) or evaluate it with "
        f"`occult eval`, which apply the pruning "
        f"stored in `config.json` (`occult_config`, `{PRUNING_CONFIG_KEY}`).\n"
        f"{_END}\n\n"
    )
    blank = rest[: len(rest) - len(rest.lstrip("\r\n"))]  # kept before the section: stripping it gives `body` back
    return head + blank + section + rest[len(blank) :]


def _limits(config: OccultConfig) -> str:
    """The pruning's limits in words: `N_d = 2 of 8 devices`, `N_n = 1 of 4 nodes (2 devices each)`, or both."""
    limits = []
    if config.max_devices_per_token is not None:
        limits.append(f"N_d = {config.max_devices_per_token} of {config.num_devices} devices")
    if config.max_nodes_per_token is not None:
        per_node = config.devices_per_node
        nodes = "" if per_node is None else f" of {config.num_devices // per_node} nodes ({per_node} devices each)"
        limits.append(f"N_n = {config.max_nodes_per_token}{nodes or ' nodes'}")
    return " and ".join(limits)


def strip_pruning_section(card: str) -> str:
    """`card` without its occult_hf pruning section (a model saved exact over a pruned one's directory)."""
    return re.sub(re.escape(_BEGIN) + r".*?" + re.escape(_END) + r"\n*", "", card, flags=re.DOTALL)


__all__ = ["CARD_FILENAME", "PRUNING_CONFIG_KEY", "card_with_pruning", "pruning_description", "strip_pruning_section"]
