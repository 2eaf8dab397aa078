"""occult_hf: Occult (arXiv 2505.13345) expert parallelism for Hugging Face Transformers.

Importing the package lets `AutoModelForCausalLM.from_pretrained(..., occult_config=...)` replace a
model's MoE blocks (see `hf.apply.install`; every wrapper this package puts on transformers is in
`hf.compat`; `occult_hf.uninstall()` removes them). It also registers the native model classes of `occult_hf.models`
(DeepSeek-MoE, `model_type "deepseek"`) with transformers' Auto classes, and, on transformers >= 5.23,
Occult as transformers' own expert-parallel implementation `DistributedConfig(ep_implementation="occult")`
(`occult_hf.hf.native_ep`).

What needs transformers' Trainer or peft is imported when first used, so that `import occult_hf`
costs little more than importing transformers' model classes: `occult_hf.OccultCallback` (a
`TrainerCallback`; transformers' callback module imports peft), and the wrappers on `Trainer` and on
peft's `PeftModel`, which go on when those modules are imported (`utils.after_import`).
"""

from .hf.checkpointing import snapshot_experts
from .config import OccultConfig
from .hf.apply import (
    apply_occult,
    install,
    occult_config_of,
    occult_modules,
    reset_counters,
    track_routing,
    uninstall,
    unapply_occult,
)
from .hf.native_ep import apply_occult_ep, register_ep_implementation
from .models import register_models
from .moe import OccultMoE
from .placement import Placement, available_planners, plan_placement
from .profile import LayerRouting, RoutingProfile
from .profile import ProfileCollector

__version__ = "0.1.0"


def __getattr__(name: str):
    if name == "OccultCallback":  # imported on first use: its base class's module imports peft (seconds)
        from .hf.callback import OccultCallback

        return OccultCallback
    raise AttributeError(f"module 'occult_hf' has no attribute {name!r}")


install()
register_models()
register_ep_implementation()

__all__ = [
    "LayerRouting",
    "OccultCallback",
    "OccultConfig",
    "OccultMoE",
    "Placement",
    "ProfileCollector",
    "RoutingProfile",
    "__version__",
    "apply_occult",
    "apply_occult_ep",
    "available_planners",
    "install",
    "occult_config_of",
    "occult_modules",
    "plan_placement",
    "reset_counters",
    "snapshot_experts",
    "track_routing",
    "unapply_occult",
    "uninstall",
]
