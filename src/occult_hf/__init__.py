"""occult_hf: Occult (arXiv 2505.13345) expert parallelism for Hugging Face Transformers."""

from .config import OccultConfig
from .placement import Placement

__version__ = "0.1.0"

__all__ = ["OccultConfig", "Placement", "__version__"]
