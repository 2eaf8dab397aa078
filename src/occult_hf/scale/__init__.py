"""A calibrated cost model of MoE layers and models past one node (`occult plan-cluster`; docs/scale.md).

No machine with more than two GPUs has been lent to the project, so what dedup, hierarchical exchange, node-aware
placement and node-limited pruning are worth at 8-256 GPUs is modelled: a few physical parameters fitted or read on
the H200 measurements, checked against every measured two-GPU row, then applied to real routing replayed at D.

Modules, in import order (each imports only those above it):

* `specs`: the models' dimensions; `synthetic`: a finer routing split from a real one;
* `traffic`: a layer's rows, bytes and pairs on its busiest device, replayed from routing or from a measured CT;
* `measurements`: the measured points, read from docs/ and shipped as `h200_measurements.json`;
* `parameters`: the parameter set; `cost`: the equations; `calibration`: the parameters fitted;
  `validation`: the measured rows predicted; `spread`: the other measurements of each row's work;
* `methods`: method names; `routing`: traces fitted to a model, planning and held-out halves;
* `projection`: every method at every D; `report`: tables and plot.
"""

from .calibration import calibrate
from .cost import Cluster
from .measurements import load_measurements, read_measurements
from .methods import DEFAULT_METHODS, parse_method
from .parameters import Calibration
from .projection import Projected, project
from .routing import fit_to_model, load_routing
from .specs import MODEL_SPECS, model_spec
from .validation import validate

__all__ = [
    "Calibration", "Cluster", "DEFAULT_METHODS", "MODEL_SPECS", "Projected", "calibrate", "fit_to_model",
    "load_measurements", "load_routing", "model_spec", "parse_method", "project", "read_measurements", "validate",
]  # fmt: skip
