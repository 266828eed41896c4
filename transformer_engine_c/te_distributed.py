"""`transformer_engine.pytorch.distributed`'s names that need none of the
layers' collectives (distributed.py re-exports them beside its TE-named
first-dimension collectives): the RNG states tracker and the
activation-recompute context. Imports nothing of distributed.py, which
checkpoint.py and distributed.py itself build on.

The tracker's states are those of the generator a model's random ops draw
from: the current CUDA device's where CUDA is available (TE's), else the
CPU's default generator, so dropout under `fork()` is tracked on a CPU-only
host too (`device=` picks one explicitly)."""
import contextlib

import torch

from .quantization import FP8GlobalStateManager

__all__ = ["CudaRNGStatesTracker", "get_all_rng_states", "activation_recompute_forward",
           "is_fp8_activation_recompute_enabled",
           "in_fp8_activation_recompute_phase"]

_recompute = {"region": False, "phase": False}
_all_states = {}  # name -> state of every tracker's named states (TE's get_all_rng_states)


def get_all_rng_states():
    """The named states of the trackers (the latest of each name), as TE
    keeps them for CUDA graph capture."""
    return _all_states


class activation_recompute_forward(contextlib.AbstractContextManager, contextlib.ContextDecorator):
    """TE's marker of a checkpointed region: `activation_recompute` while the
    forward of a checkpointed function runs, with `recompute_phase` when it
    is the recomputation in backward. The layers keep nothing per phase
    (no FP8 state here); the queries below answer from it."""

    def __init__(self, activation_recompute=False, recompute_phase=False):
        super().__init__()
        self.activation_recompute = bool(activation_recompute)
        self.recompute_phase = bool(recompute_phase)

    def __enter__(self):
        self._before = dict(_recompute)
        _recompute["region"], _recompute["phase"] = self.activation_recompute, self.recompute_phase
        return self

    def __exit__(self, *exc):
        _recompute.update(self._before)
        return False


def is_fp8_activation_recompute_enabled():
    """Inside a recompute region with FP8 on: never true here (no FP8)."""
    return _recompute["region"] and FP8GlobalStateManager.is_fp8_enabled()


def in_fp8_activation_recompute_phase():
    return _recompute["phase"]


def _generator_device(device):
    if device is None:
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(device)
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"CudaRNGStatesTracker: device must be 'cpu' or 'cuda', got {device}")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def _get_state(device):
    return torch.get_rng_state() if device.type == "cpu" else torch.cuda.get_rng_state(device)


def _set_state(state, device):
    if device.type == "cpu":
        torch.set_rng_state(state)
    else:
        torch.cuda.set_rng_state(state, device)


class CudaRNGStatesTracker:
    """TE's named RNG states: `add(name, seed)` makes one, `fork(name)` runs
    its body drawing from it (and keeps what was drawn), the states before
    and after are the caller's. `get_states` / `set_states` save and restore
    them all (activation checkpointing does)."""

    def __init__(self, *, device=None):
        self._device = _generator_device(device)
        self.states_ = {}
        self.seeds_ = set()

    def reset(self):
        self.states_ = {}
        self.seeds_ = set()

    def get_states(self):
        """A new dict of the states (the state tensors themselves)."""
        return dict(self.states_)

    def set_states(self, states):
        if not isinstance(states, dict):
            raise TypeError(f"set_states: states must be a dict name -> state, got {type(states).__name__}")
        self.states_ = states
        _all_states.update(states)

    def add(self, name, seed):
        if not isinstance(name, str):
            raise TypeError(f"add: name must be a str, got {type(name).__name__}")
        if seed in self.seeds_:
            raise RuntimeError(f"seed {seed} already exists")
        self.seeds_.add(seed)
        if name in self.states_:
            raise RuntimeError(f"rng state {name} already exists")
        before = _get_state(self._device)
        try:
            if self._device.type == "cpu":
                torch.manual_seed(seed)
            else:
                with torch.cuda.device(self._device):
                    torch.cuda.manual_seed(seed)
            self.states_[name] = _get_state(self._device)
            _all_states[name] = self.states_[name]
        finally:
            _set_state(before, self._device)

    @contextlib.contextmanager
    def fork(self, name="model-parallel-rng"):
        if name not in self.states_:
            raise KeyError(f"rng state {name} is not added")
        before = _get_state(self._device)
        _set_state(self.states_[name], self._device)
        try:
            yield
        finally:
            self.states_[name] = _get_state(self._device)
            _set_state(before, self._device)
