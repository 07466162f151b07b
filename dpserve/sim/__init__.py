"""A simulated fleet of vLLM-like engines, for studying routing at scales no test
machine has. See README.md in this folder for the model and its limits.

    from dpserve.sim import Fault, Fleet, SimConfig
"""

from dpserve.sim.config import SimConfig, build_sim_config
from dpserve.sim.engine import Engine
from dpserve.sim.faults import Fault
from dpserve.sim.fleet import Fleet
from dpserve.sim.server import SimReplica
from dpserve.sim.tokenizer import SimTokenizer

__all__ = ["Engine", "Fault", "Fleet", "SimConfig", "SimReplica", "SimTokenizer",
           "build_sim_config"]
