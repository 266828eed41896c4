"""TransformerEngine's quantization entry points with TE 2.x semantics.

`autocast` / `fp8_autocast` set the global FP8 state that
FP8GlobalStateManager answers (enabled, recipe, group, calibrating, depth,
first module) and, for DelayedScaling, run the amax reduction and scale
update of every fp8_meta registered during the block when the outermost
autocast exits with grad enabled. For activation recompute it keeps, per
delayed-scaling fp8_meta, the forward tensors each checkpointed call cast
with, for its recompute (TE's copy_forward / get_old / restore methods).
Entered inside a function torch.compile traces (torch 2.13 and newer;
refused before), the autocast does the same when the compiled code runs,
through tec::autocast_enter / autocast_exit (_Autocast._enter_traced). The recipes (recipe.py), quantizers and Float8Tensor
(tensor/float8_tensor.py) and the FP8 engine operations (_fp8_engine.py)
are usable on their own.

Linear, LayerNormLinear and LayerNormMLP compute their GEMMs in FP8 inside
an enabled autocast (module/_fp8.py), with per-tensor or block scales; GroupedLinear and calibration
(calibrating=True) raise NotImplementedError there. Inside
quantized_model_init / fp8_model_init(enabled=True) those layers hold their
weights in FP8 (Float8Tensor parameters, or Float8BlockwiseQTensor under
Float8BlockScaling; see docs/fp8.md's "FP8 primary weights")."""
import ast
import atexit
import collections
import contextlib
import copy
import dataclasses
import weakref

import torch

from . import _fp8_meta, _library
from .recipe import DelayedScaling, Float8BlockScaling, MXFP8BlockScaling, Recipe
from .recipe import from_spec as _recipe_from_spec
from .recipe import spec as _recipe_spec

__all__ = ["autocast", "fp8_autocast", "fp8_model_init", "quantized_model_init", "get_default_fp8_recipe",
           "FP8GlobalStateManager", "is_fp8_available", "is_mxfp8_available", "is_fp8_block_scaling_available",
           "is_nvfp4_available", "check_fp8_support", "check_mxfp8_support", "check_nvfp4_support",
           "check_fp8_block_scaling_support", "get_fp8_torch_dtype", "get_default_recipe"]

def _cuda_version():
    return tuple(int(v) for v in (torch.version.cuda or "0.0").split(".")[:2])


def check_fp8_support():
    """(available, reason) for per-tensor FP8 (DelayedScaling,
    Float8CurrentScaling), TE's answer: on CUDA compute capability 8.9 or
    newer (Ada with CUDA 12.1+, Hopper); the reason is empty when available.
    Without CUDA, FP8 is emulated exactly on the CPU: available."""
    if not torch.cuda.is_available():
        return True, ""
    cc = torch.cuda.get_device_capability()
    if cc < (8, 9):
        return False, (f"Device compute capability 8.9 or higher required for FP8 execution "
                       f"({torch.cuda.get_device_name()} is {cc[0]}.{cc[1]}).")
    if cc < (9, 0) and _cuda_version() < (12, 1):
        return False, "Cuda version 12.1 or higher required for FP8 execution on Ada."
    return True, ""


def check_mxfp8_support():
    """(available, reason) for MXFP8BlockScaling: never available here. TE's
    reason where TE would refuse too (below compute capability 10.0, the
    CPU), else that this package does not offer it."""
    if torch.cuda.is_available() and torch.cuda.get_device_capability() >= (10, 0):
        return False, "MXFP8 (Blackwell's block scaling) is not offered by transformer_engine_c."
    return False, "Device compute capability 10.0 or higher required for MXFP8 execution."


def check_nvfp4_support():
    """(available, reason) for NVFP4BlockScaling: never available here (see
    check_mxfp8_support)."""
    if torch.cuda.is_available() and torch.cuda.get_device_capability() >= (10, 0):
        return False, "NVFP4 (Blackwell's FP4 block scaling) is not offered by transformer_engine_c."
    return False, "Device compute capability 10.0 or higher required for NVFP4 execution."


def is_fp8_available(return_reason=False):
    """TE's module-level form: a bool, or (bool, reason)."""
    ok, reason = check_fp8_support()
    return (ok, reason) if return_reason else ok


def check_fp8_block_scaling_support():
    """(available, reason) for Float8BlockScaling, TE's answer for Hopper
    (compute capability 9.x with CUDA 12.9+, whose cuBLASLt has the 1x128
    and 128x128 scale modes). TE emulates the recipe with MXFP8 on sm_100+,
    which this package does not: unavailable there. Without CUDA it is
    emulated exactly on the CPU: available."""
    if not torch.cuda.is_available():
        return True, ""
    cc = torch.cuda.get_device_capability()
    if cc >= (10, 0):
        return False, (f"Float8BlockScaling on compute capability {cc[0]}.{cc[1]}: TE emulates it with MXFP8 there, "
                       "which transformer_engine_c does not offer (it runs block scaling on Hopper, 9.0)")
    if cc < (9, 0) or _cuda_version() < (12, 9):
        return False, "FP8 block scaled GEMM requires compute capability 9.0 or higher and CUDA >= 12.9."
    return True, ""


def get_fp8_torch_dtype(fp8_recipe, fprop_tensor=True):
    """torch's float8 dtype of a recipe's forward (fprop_tensor) or backward
    tensors: E4M3, or E5M2 for HYBRID's backward."""
    return _fp8_meta.fp8_dtype_of(fp8_recipe.fp8_format, fprop_tensor)


def get_default_fp8_recipe():
    """TE's default: DelayedScaling below Blackwell, MXFP8 on sm_100+ (which
    this package refuses when enabled)."""
    if torch.cuda.is_available() and torch.cuda.get_device_capability() >= (10, 0):
        return MXFP8BlockScaling()
    return DelayedScaling()


def get_default_recipe():
    """TE's name: the default training recipe (get_default_fp8_recipe)."""
    return get_default_fp8_recipe()


# (id(recipe), id(group)) -> (recipe, a weak reference to the group, the recipe's field values then, the key):
# weak, so that the memo never keeps a process group alive past destroy_process_group
_key_memo = {}


def _no_group():
    return None


def _group_key(group):
    if group is None or not torch.distributed.is_available() or not torch.distributed.is_initialized():
        return None
    return tuple(torch.distributed.get_process_group_ranks(group))


def _world_size(group):
    if not torch.distributed.is_available() or not torch.distributed.is_initialized():
        return 1
    return torch.distributed.get_world_size(group)


# fp8_meta's key (TE's) of its queue in FP8GlobalStateManager.fp8_tensors_recompute_buffer
RECOMPUTE_POSITION_KEY = "global_fp8_buffer_pos_fwd_recompute"
# checkpointed forwards per fp8_meta whose recompute has not run yet (the oldest dropped beyond this)
RECOMPUTE_STASH = 1024


class FP8GlobalStateManager:
    """TE's global FP8 state: what the active autocast set, and the global
    buffers of the amaxes, histories and scales of every fp8_meta that took
    part in the current autocast (keyed per direction and autocast)."""

    FP8_ENABLED = False
    FP8_CALIBRATION = False
    FP8_RECIPE = None
    FP8_DISTRIBUTED_GROUP = None
    FP8_PARAMETERS = False
    HIGH_PRECISION_INIT_VAL = False
    IS_FIRST_FP8_MODULE = False
    FP8_GRAPH_CAPTURING = False
    AUTOCAST_DEPTH = 0
    SKIP_FP8_WEIGHT_UPDATE = None
    autocast_arguments = {}
    global_amax_buffer = {}
    global_amax_history_buffer = {}
    global_scale_buffer = {}
    global_scale_inv_buffer = {}
    # activation recompute: per fp8_meta that stashed, its checkpointed forwards' scales, oldest first
    fp8_tensors_recompute_buffer = []
    _registrations = 0  # counts the registrations that appended to the buffers
    _step_updates = {}  # forward (a bool) -> _StepUpdate made from the buffers at that count

    @classmethod
    def reset(cls):
        """Back to the state at import (tests; after a failed step)."""
        cls.FP8_ENABLED = cls.FP8_CALIBRATION = cls.FP8_PARAMETERS = cls.HIGH_PRECISION_INIT_VAL = False
        _mirror(cls)
        cls.FP8_RECIPE = cls.FP8_DISTRIBUTED_GROUP = None
        cls.IS_FIRST_FP8_MODULE = cls.FP8_GRAPH_CAPTURING = False
        cls.AUTOCAST_DEPTH = 0
        cls.SKIP_FP8_WEIGHT_UPDATE = None
        cls.autocast_arguments = {}
        cls.global_amax_buffer = {}
        cls.global_amax_history_buffer = {}
        cls.global_scale_buffer = {}
        cls.global_scale_inv_buffer = {}
        cls.fp8_tensors_recompute_buffer = []
        cls._step_updates = {}
        _key_memo.clear()

    # ---- availability

    is_fp8_available = staticmethod(check_fp8_support)
    is_mxfp8_available = staticmethod(check_mxfp8_support)
    is_nvfp4_available = staticmethod(check_nvfp4_support)
    is_fp8_block_scaling_available = staticmethod(check_fp8_block_scaling_support)

    # ---- queries (TE's names)

    @classmethod
    def is_fp8_enabled(cls):
        return cls.FP8_ENABLED

    @classmethod
    def is_fp8_calibration(cls):
        return cls.FP8_CALIBRATION

    @classmethod
    def with_fp8_parameters(cls):
        return cls.FP8_PARAMETERS

    @classmethod
    def with_high_precision_init_val(cls):
        return cls.HIGH_PRECISION_INIT_VAL

    @classmethod
    def fp8_graph_capturing(cls):
        return cls.FP8_GRAPH_CAPTURING

    @classmethod
    def set_skip_fp8_weight_update_tensor(cls, skip, device=None):
        """TE's weight-caching flag of CUDA graphs: a float32 tensor of one
        element that the weight casts captured with fp8_weight_caching read
        when they run (nonzero: the cast writes nothing, the cached FP8 weight
        stays). Made on first use on `device` (the current CUDA device, the
        CPU without CUDA; a new one where another device is asked for), then
        filled with `skip` on the device. Returns it."""
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
        device = torch.device(device)
        flag = cls.SKIP_FP8_WEIGHT_UPDATE
        if flag is None or flag.device != device:
            flag = cls.SKIP_FP8_WEIGHT_UPDATE = torch.zeros(1, dtype=torch.float32, device=device)
        flag.fill_(float(bool(skip)))
        return flag

    @classmethod
    def get_skip_fp8_weight_update_tensor(cls):
        """The flag of set_skip_fp8_weight_update_tensor, or None (no weight
        caching under capture)."""
        return cls.SKIP_FP8_WEIGHT_UPDATE

    @classmethod
    def is_first_fp8_module(cls):
        """True for the first module of the outermost autocast that asks
        (which then owns the backward amax reduction); False afterwards."""
        first = cls.IS_FIRST_FP8_MODULE
        cls.IS_FIRST_FP8_MODULE = False
        return first

    @classmethod
    def get_fp8_recipe(cls):
        return cls.FP8_RECIPE if cls.FP8_RECIPE is not None else get_default_fp8_recipe()

    @classmethod
    def get_fp8_group(cls):
        return cls.FP8_DISTRIBUTED_GROUP

    @classmethod
    def get_autocast_depth(cls):
        return cls.AUTOCAST_DEPTH

    @staticmethod
    def get_meta_tensor_key(forward=True):
        return "scaling_fwd" if forward else "scaling_bwd"

    @staticmethod
    def get_fwd_bwd_key(forward=True):
        return "forward" if forward else "backward"

    @staticmethod
    def get_buffer_info():
        return "buffer_index_and_autocast_key"

    @classmethod
    def get_unique_autocast_key(cls, recipe=None, group=None):
        """Recipes equal in every field, and groups of the same ranks, share
        one key (and so one buffer and one reduction). Remembered per recipe
        and group object while the recipe's fields stay as they were (every
        autocast asks; making the key costs more than the rest of an
        autocast's entry)."""
        memo = _key_memo.get((id(recipe), id(group)))
        now = tuple(vars(recipe).values()) if hasattr(recipe, "__dict__") else None
        if memo is not None and memo[0] is recipe and memo[1]() is group and now is not None and memo[2] == now:
            return memo[3]
        fields = [(f.name, getattr(recipe, f.name)) for f in dataclasses.fields(recipe)] \
            if dataclasses.is_dataclass(recipe) else recipe
        key = f"{type(recipe).__name__}{fields!r}:{_group_key(group)}"
        if now is not None:
            if len(_key_memo) >= 64:
                _key_memo.clear()
            try:
                ref = _no_group if group is None else weakref.ref(group)
            except TypeError:  # an object without weak references: not remembered
                return key
            _key_memo[(id(recipe), id(group))] = (recipe, ref, copy.deepcopy(now), key)
        return key

    # ---- autocast state

    @classmethod
    def get_autocast_state(cls):
        return (cls.FP8_ENABLED, cls.FP8_CALIBRATION, cls.FP8_RECIPE, cls.FP8_DISTRIBUTED_GROUP,
                cls.IS_FIRST_FP8_MODULE, cls.FP8_GRAPH_CAPTURING)

    @classmethod
    def set_autocast_state(cls, state):
        (cls.FP8_ENABLED, cls.FP8_CALIBRATION, cls.FP8_RECIPE, cls.FP8_DISTRIBUTED_GROUP,
         cls.IS_FIRST_FP8_MODULE, cls.FP8_GRAPH_CAPTURING) = state
        _mirror(cls)

    # TE's older names
    get_fp8_autocast_state = get_autocast_state
    set_fp8_autocast_state = set_autocast_state

    @classmethod
    def autocast_enter(cls, enabled=False, calibrating=False, fp8_recipe=None, fp8_group=None, _graph=False):
        """Set the state for an autocast block (the caller saved the old)."""
        recipe = get_default_fp8_recipe() if fp8_recipe is None else fp8_recipe
        if not isinstance(recipe, Recipe):
            raise TypeError(f"recipe must be a transformer_engine_c.recipe.Recipe, got {type(recipe).__name__}")
        if enabled or calibrating:
            reason = recipe.unsupported_reason()
            if reason:
                raise NotImplementedError(reason)
        if enabled:
            ok, reason = (check_fp8_block_scaling_support if isinstance(recipe, Float8BlockScaling)
                          else check_fp8_support)()
            if not ok:
                raise RuntimeError(reason)
        cls.autocast_arguments[cls.get_unique_autocast_key(recipe, fp8_group)] = (recipe, fp8_group)
        cls.FP8_ENABLED = bool(enabled)
        cls.FP8_CALIBRATION = bool(calibrating)
        _mirror(cls)
        cls.FP8_RECIPE = recipe
        cls.FP8_DISTRIBUTED_GROUP = fp8_group
        cls.FP8_GRAPH_CAPTURING = bool(_graph)
        if cls.AUTOCAST_DEPTH == 0:
            cls.IS_FIRST_FP8_MODULE = True
        cls.AUTOCAST_DEPTH += 1

    @classmethod
    def autocast_exit(cls, enabled, _graph=False, _grad=None):
        """After the state is restored: at the outermost exit with grad on
        (and outside graph capture), reduce and update the forward amaxes.
        _grad: the grad mode the block ran in, where it is not the current
        one (a compiled forward runs without grad)."""
        cls.AUTOCAST_DEPTH -= 1
        if cls.AUTOCAST_DEPTH == 0:
            grad = torch.is_grad_enabled() if _grad is None else _grad
            if enabled and not _graph and grad:
                cls.reduce_and_update_fp8_tensors(forward=True)

    # ---- delayed scaling's global buffers

    @classmethod
    def add_fp8_tensors_to_global_buffer(cls, fp8_meta):
        """Register a module's fp8_meta (once: its tensors are updated in
        place, so the buffers keep views of them) under its recipe and group
        (fp8_meta["recipe"], fp8_meta["fp8_group"]; the active autocast's
        where absent). A module called twice in one step maxes both calls'
        amaxes into the same history row."""
        info_key = cls.get_buffer_info()
        if info_key in fp8_meta:
            return
        recipe = fp8_meta.get("recipe") or cls.get_fp8_recipe()
        group = fp8_meta.get("fp8_group")
        if group is None:
            group = cls.FP8_DISTRIBUTED_GROUP
        autocast_key = cls.get_unique_autocast_key(recipe, group)
        cls.autocast_arguments.setdefault(autocast_key, (recipe, group))
        info = fp8_meta[info_key] = {}
        cls._registrations += 1
        for forward in (True, False):
            meta_key = cls.get_meta_tensor_key(forward)
            if meta_key not in fp8_meta:
                continue
            key = f"{cls.get_fwd_bwd_key(forward)}_{autocast_key}"
            meta = fp8_meta[meta_key]
            cls.global_amax_buffer.setdefault(key, []).append(meta.amax_history[0])
            cls.global_amax_history_buffer.setdefault(key, []).append(meta.amax_history)
            cls.global_scale_buffer.setdefault(key, []).append(meta.scale)
            cls.global_scale_inv_buffer.setdefault(key, []).append(meta.scale_inv)
            info[key] = len(cls.global_amax_buffer[key]) - 1

    @classmethod
    def reduce_and_update_fp8_tensors(cls, forward=True):
        """For every registered group of this direction (forward: at the
        outermost autocast's exit; backward: at the end of the first module's
        backward): max-reduce the current amaxes (history row 0) over the
        group when recipe.reduce_amax and the group has more than one rank,
        in one collective per group, then update each fp8_meta in place
        (_fp8_meta.amax_and_scale_update). Device-side throughout."""
        update = cls._step_updates.get(forward)
        if update is None or update.registrations != cls._registrations:
            update = cls._step_updates[forward] = _StepUpdate(cls, forward)
        arguments = cls.autocast_arguments
        for autocast_key, amaxes, run in update.buffers:
            recipe, group = arguments[autocast_key]
            if recipe.reduce_amax and _world_size(group) > 1:
                flat = torch.cat(amaxes)
                torch.distributed.all_reduce(flat, op=torch.distributed.ReduceOp.MAX, group=group)
                for row, part in zip(amaxes, flat.split([a.numel() for a in amaxes])):
                    row.copy_(part)
            run()

    # ---- activation recompute of delayed scaling (TE's names and fp8_meta keys)

    @classmethod
    def copy_forward_fp8_meta_tensors_for_recompute(cls, fp8_meta):
        """In a checkpointed forward: stash copies of the forward scales,
        their inverses and the amax history a delayed-scaling fp8_meta casts
        with, so that the recompute in backward casts with the same ones.
        The stash is a queue per fp8_meta (one entry per checkpointed call,
        the oldest dropped past RECOMPUTE_STASH), found through
        fp8_meta["global_fp8_buffer_pos_fwd_recompute"]. Other recipes: no-op."""
        if not _delayed_meta(fp8_meta, "copy_forward_fp8_meta_tensors_for_recompute"):
            return
        fwd = fp8_meta["scaling_fwd"]
        entry = (fwd.amax_history.clone(), fwd.scale.clone(), fwd.scale_inv.clone())
        buffer = cls.fp8_tensors_recompute_buffer
        pos = _recompute_position(buffer, fp8_meta)
        if pos is None:  # its first stash (or the first since a reset)
            queue = _StashQueue(maxlen=RECOMPUTE_STASH)
            queue.owner = id(fp8_meta)
            buffer.append(queue)
            pos = fp8_meta[RECOMPUTE_POSITION_KEY] = len(buffer) - 1
        buffer[pos].append(entry)

    @classmethod
    def get_old_fp8_meta_tensors_for_recompute(cls, fp8_meta):
        """In the recompute: keep the fp8_meta's current forward tensors
        (fp8_meta["updated_amax_history_fwd"], ["updated_scale_fwd"],
        ["updated_scale_inv_fwd"]) and copy the oldest stash into them, in
        place; restore_fp8_meta_tensors puts the current ones back.
        Other recipes: no-op."""
        if not _delayed_meta(fp8_meta, "get_old_fp8_meta_tensors_for_recompute"):
            return
        buffer = cls.fp8_tensors_recompute_buffer
        pos = _recompute_position(buffer, fp8_meta)
        if pos is None or not buffer[pos]:
            raise RuntimeError("get_old_fp8_meta_tensors_for_recompute: fp8_meta has no stashed forward scales "
                               "(copy_forward_fp8_meta_tensors_for_recompute stashes them in the checkpointed "
                               "forward; the FP8 state was reset in between, or the recompute ran twice)")
        amax_history, scale, scale_inv = buffer[pos].popleft()
        fwd = fp8_meta["scaling_fwd"]
        fp8_meta["updated_amax_history_fwd"] = fwd.amax_history.clone()
        fp8_meta["updated_scale_fwd"] = fwd.scale.clone()
        fp8_meta["updated_scale_inv_fwd"] = fwd.scale_inv.clone()
        fwd.amax_history.copy_(amax_history)
        fwd.scale.copy_(scale)
        fwd.scale_inv.copy_(scale_inv)

    @staticmethod
    def restore_fp8_meta_tensors(fp8_meta):
        """After the recompute: the forward tensors that
        get_old_fp8_meta_tensors_for_recompute kept, copied back in place.
        Other recipes: no-op."""
        if not _delayed_meta(fp8_meta, "restore_fp8_meta_tensors"):
            return
        if "updated_scale_fwd" not in fp8_meta:
            raise RuntimeError("restore_fp8_meta_tensors: fp8_meta holds no kept forward scales "
                               "(get_old_fp8_meta_tensors_for_recompute keeps them)")
        fwd = fp8_meta["scaling_fwd"]
        fwd.amax_history.copy_(fp8_meta["updated_amax_history_fwd"])
        fwd.scale.copy_(fp8_meta["updated_scale_fwd"])
        fwd.scale_inv.copy_(fp8_meta["updated_scale_inv_fwd"])


class _StashQueue(collections.deque):
    """One fp8_meta's stashed forward tensors; `owner` is the meta's id."""
    owner = None


def _recompute_position(buffer, fp8_meta):
    """fp8_meta's queue's index in `buffer`, or None where it has none (a
    position left from before a reset names another meta's queue or none)."""
    pos = fp8_meta.get(RECOMPUTE_POSITION_KEY)
    if pos is None or pos >= len(buffer) or buffer[pos].owner != id(fp8_meta):
        return None
    return pos


def _delayed_meta(fp8_meta, name):
    """Whether fp8_meta holds delayed scaling's tensors (its recipe is a
    DelayedScaling); checks that it is an fp8_meta."""
    if not isinstance(fp8_meta, dict):
        raise TypeError(f"{name}: fp8_meta must be a module's fp8_meta dict, got {type(fp8_meta).__name__}")
    recipe = fp8_meta.get("recipe")
    if recipe is None or not recipe.delayed():
        return False
    if "scaling_fwd" not in fp8_meta:
        raise ValueError(f"{name}: fp8_meta has a DelayedScaling recipe but no 'scaling_fwd' tensors")
    return True


class _StepUpdate:
    """One direction's update of every registered fp8_meta, prepared from
    the global buffers as they are after `registrations` registrations: per
    buffer, its autocast key (whose recipe and group the update reads when
    it runs), its amaxes (the histories' rows 0) and its metas' update
    (_fp8_meta.updater: arguments checked, engine pointers taken). A
    registration that appends makes it again."""

    __slots__ = ("registrations", "buffers")

    def __init__(self, state, forward):
        self.registrations = state._registrations
        prefix = state.get_fwd_bwd_key(forward) + "_"
        self.buffers = []
        for key, amaxes in state.global_amax_buffer.items():
            if not key.startswith(prefix) or not amaxes:
                continue
            autocast_key = key[len(prefix):]
            recipe = state.autocast_arguments[autocast_key][0]
            fp8_max = recipe.fp8_format.value.max_fwd if forward else recipe.fp8_format.value.max_bwd
            metas = [_fp8_meta.FP8TensorMeta.of(scale, scale_inv, hist) for hist, scale, scale_inv in
                     zip(state.global_amax_history_buffer[key], state.global_scale_buffer[key],
                         state.global_scale_inv_buffer[key])]
            self.buffers.append((autocast_key, amaxes, _fp8_meta.updater(metas, fp8_max, recipe)))


def autocast(enabled=True, calibrating=False, recipe=None, amax_reduction_group=None, _graph=False):
    """TE 2.x's quantized autocast (see this module's docstring): a context
    manager, also usable as a decorator."""
    return _Autocast(enabled, calibrating, recipe, amax_reduction_group, _graph)


def fp8_autocast(enabled=True, calibrating=False, fp8_recipe=None, fp8_group=None, _graph=False):
    """TE's older name of autocast (fp8_recipe, fp8_group)."""
    return _Autocast(enabled, calibrating, fp8_recipe, fp8_group, _graph)


# FP8_ENABLED mirrored in a module global: torch.compile reads it while
# tracing a layer, and a module global's value is a guard of the compiled
# graph on every torch (a class attribute's is not on torch 2.8).
fp8_enabled = False


def _mirror(state):
    global fp8_enabled
    fp8_enabled = bool(state.FP8_ENABLED)


# The traced enter sets FP8GlobalStateManager's class attributes, so that the
# layers traced inside it are FP8 calls: torch's compiler traces an
# assignment to a class attribute from torch 2.13 on; before it the autocast
# is refused while compiling, naming the way out.
_OLD_TORCH_REFUSAL = None if tuple(int(v) for v in torch.__version__.split(".")[:2]) >= (2, 13) else (
    f"te.autocast / fp8_autocast entered inside a function torch.compile traces needs torch 2.13 or newer (this "
    f"is torch {torch.__version__}): enter the autocast around the call of the compiled function")


class _Autocast(contextlib.ContextDecorator):
    """One autocast block: enter sets the state (the one it found kept),
    exit restores it, exceptions included, and at the outermost exit runs
    the forward update (FP8GlobalStateManager.autocast_exit). Entered once;
    as a decorator each call enters a fresh one."""

    __slots__ = ("enabled", "calibrating", "recipe", "group", "graph", "saved", "grad")

    def __init__(self, enabled, calibrating, recipe, group, graph):
        self.enabled, self.calibrating, self.recipe, self.group, self.graph = (
            enabled, calibrating, recipe, group, graph)
        self.saved = None
        self.grad = None

    def _recreate_cm(self):
        return _Autocast(self.enabled, self.calibrating, self.recipe, self.group, self.graph)

    def __enter__(self):
        if self.saved is not None:
            raise RuntimeError("an autocast context is entered once (make a new one per block)")
        if torch.compiler.is_compiling():
            self._enter_traced()
            return
        state = FP8GlobalStateManager.get_autocast_state()
        FP8GlobalStateManager.autocast_enter(enabled=self.enabled, calibrating=self.calibrating,
                                             fp8_recipe=self.recipe, fp8_group=self.group, _graph=self.graph)
        self.saved = state

    def __exit__(self, *exc):
        if self.grad is not None:
            self._exit_traced()
            return False
        FP8GlobalStateManager.set_autocast_state(self.saved)
        FP8GlobalStateManager.autocast_exit(self.enabled, _graph=self.graph)
        return False

    # Entered inside a function torch.compile traces: the trace sees the
    # state the block sets (its layers are traced as FP8 calls), and the
    # compiled code sets and restores it where the eager enter and exit
    # would, through tec::autocast_enter / tec::autocast_exit, the exit
    # running the forward update of delayed scaling.

    def _enter_traced(self):
        if _OLD_TORCH_REFUSAL:
            _library.refuse(_OLD_TORCH_REFUSAL)
        if self.graph:
            raise RuntimeError("te.autocast(_graph=True) is make_graphed_callables' own and is not entered inside "
                               "a compiled function")
        if self.group is not None:
            raise NotImplementedError("te.autocast / fp8_autocast with an amax_reduction_group (fp8_group) inside "
                                      "a function torch.compile traces is not supported: enter it around the call "
                                      "of the compiled function")
        recipe = self.recipe
        if recipe is not None:
            if not isinstance(recipe, Recipe):
                raise TypeError(f"recipe must be a transformer_engine_c.recipe.Recipe, got {type(recipe).__name__}")
            if self.enabled or self.calibrating:
                reason = recipe.unsupported_reason()
                if reason:
                    raise NotImplementedError(reason)
            try:
                described = repr(_recipe_spec(recipe))
            except TypeError as e:
                raise NotImplementedError(f"te.autocast inside a function torch.compile traces: the recipe crosses "
                                          f"into the compiled code by value, and {e} (enter the autocast around "
                                          f"the call of the compiled function)") from None
        S = FP8GlobalStateManager
        self.saved = S.get_autocast_state()
        self.grad = torch.is_grad_enabled()
        _library.autocast_enter("" if recipe is None else described, bool(self.enabled), bool(self.calibrating))
        S.FP8_ENABLED, S.FP8_CALIBRATION = bool(self.enabled), bool(self.calibrating)
        _mirror(S)
        S.FP8_RECIPE, S.FP8_DISTRIBUTED_GROUP, S.FP8_GRAPH_CAPTURING = recipe, None, False

    def _exit_traced(self):
        _library.autocast_exit(bool(self.enabled), self.grad)
        FP8GlobalStateManager.set_autocast_state(self.saved)


# The states that the autocasts entered inside compiled code found, innermost last.
_in_graph = []


# The recipes of those autocasts, one per description (recipe.spec's repr)
_in_graph_recipes = {}


def _enter_in_graph(described, enabled, calibrating):
    """tec::autocast_enter at run time: the eager enter with the recipe the
    trace described ("": the default recipe)."""
    recipe = None
    if described:
        recipe = _in_graph_recipes.get(described)
        if recipe is None:
            recipe = _in_graph_recipes[described] = _recipe_from_spec(ast.literal_eval(described))
    state = FP8GlobalStateManager.get_autocast_state()
    FP8GlobalStateManager.autocast_enter(enabled=enabled, calibrating=calibrating, fp8_recipe=recipe)
    _in_graph.append(state)


def _exit_in_graph(enabled, grad):
    """tec::autocast_exit at run time: the state restored, and at the
    outermost exit of a block traced with grad, the forward update."""
    FP8GlobalStateManager.set_autocast_state(_in_graph.pop())
    FP8GlobalStateManager.autocast_exit(enabled, _grad=grad)


def unwind_in_graph():
    """After a failure inside compiled code: leave every autocast that the
    compiled code entered, as a `with` block left by an exception does
    (without the forward update)."""
    while _in_graph:
        FP8GlobalStateManager.set_autocast_state(_in_graph.pop())
        FP8GlobalStateManager.AUTOCAST_DEPTH -= 1


_library.autocast_hooks(_enter_in_graph, _exit_in_graph)


def _init_recipe(what, recipe):
    """The recipe a model-init context quantizes parameters for (the default
    when None), checked: a Recipe this package computes with and whose
    weights it can hold in FP8 (per-tensor scaling, or 128x128 blocks)."""
    recipe = get_default_fp8_recipe() if recipe is None else recipe
    if not isinstance(recipe, Recipe):
        raise TypeError(f"{what}: recipe must be a transformer_engine_c.recipe.Recipe or None, got "
                        f"{type(recipe).__name__}")
    reason = recipe.unsupported_reason()
    if reason:
        raise NotImplementedError(f"{what}: recipe={type(recipe).__name__}: {reason}")
    if isinstance(recipe, Float8BlockScaling) and recipe.w_block_scaling_dim != 2:
        raise NotImplementedError(f"{what}: recipe=Float8BlockScaling(w_block_scaling_dim="
                                  f"{recipe.w_block_scaling_dim}): block-scaled FP8 primary weights are 128x128 "
                                  "blocks (w_block_scaling_dim=2), whose transpose is made from the bytes")
    return recipe


@contextlib.contextmanager
def quantized_model_init(enabled=True, recipe=None, preserve_high_precision_init_val=False, _name=None):
    """TE's quantized_model_init: Linear, LayerNormLinear and LayerNormMLP
    built inside it with enabled=True hold their 2-D weights in FP8 (FP8
    primary weights) for `recipe` (the default recipe when None):
    Float8Tensor parameters for DelayedScaling and Float8CurrentScaling,
    Float8BlockwiseQTensor (128x128 blocks) for Float8BlockScaling.
    preserve_high_precision_init_val keeps each weight's initial value on the
    CPU (param.get_high_precision_init_val() / clear_high_precision_init_val(),
    as TE). enabled=False builds parameters as usual. As in TE the recipe is
    also the state's FP8_RECIPE inside the block."""
    what = _name or "quantized_model_init"
    if enabled:
        recipe = _init_recipe(what, recipe)
    S = FP8GlobalStateManager
    saved = (S.FP8_PARAMETERS, S.FP8_RECIPE, S.HIGH_PRECISION_INIT_VAL)
    S.FP8_PARAMETERS = bool(enabled)
    if enabled:
        S.FP8_RECIPE = recipe
    S.HIGH_PRECISION_INIT_VAL = bool(enabled and preserve_high_precision_init_val)
    try:
        yield
    finally:
        S.FP8_PARAMETERS, S.FP8_RECIPE, S.HIGH_PRECISION_INIT_VAL = saved


@contextlib.contextmanager
def fp8_model_init(enabled=True, recipe=None, preserve_high_precision_init_val=False):
    """TE's older name of quantized_model_init."""
    with quantized_model_init(enabled, recipe, preserve_high_precision_init_val, _name="fp8_model_init"):
        yield


def _answer(check, return_reason):
    ok, reason = check()
    return (ok, reason) if return_reason else ok


def is_mxfp8_available(return_reason=False):
    return _answer(FP8GlobalStateManager.is_mxfp8_available, return_reason)


def is_nvfp4_available(return_reason=False):
    return _answer(FP8GlobalStateManager.is_nvfp4_available, return_reason)


def is_fp8_block_scaling_available(return_reason=False):
    return _answer(FP8GlobalStateManager.is_fp8_block_scaling_available, return_reason)


def _release_at_exit():
    """atexit: drop the FP8 state's references to process groups (the
    autocast arguments, the active group, the key memo) while the
    interpreter is whole: a gloo group whose last reference goes during
    finalization joins its worker threads too late and the process aborts
    (userbuffers._release_at_exit does the same for the communicators)."""
    FP8GlobalStateManager.reset()


atexit.register(_release_at_exit)
